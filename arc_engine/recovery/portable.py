"""arc_engine's own state in a checkpoint as JSON, never pickle: reading it back cannot run code.

What arc_engine stores beside the training tensors -- monitor histories, the recovery controller, counters, the
framework's small extra state (LR scheduler, loss scaler, step counters) and each rank's RNG states -- goes through
:func:`dumps` / :func:`loads`: UTF-8 JSON, with the few non-JSON types it holds tagged:

* tensors and numpy arrays: ``{"__tensor__": {"dtype", "shape", "data"}}`` / ``{"__ndarray__": ...}`` with the
  raw little-endian bytes in base64 (exact, any dtype numpy knows, e.g. the uint8 RNG states);
* tuples (Python's and numpy's RNG states are tuples), bytes, numpy scalars, ``torch.dtype``;
* dicts whose keys are not all strings (optimizer and scheduler states key by int) or that would read as a tag:
  ``{"__dict__": [[key, value], ...]}``;
* NaN and infinities as JSON's ``NaN`` / ``Infinity`` tokens (Python's json reads them back exactly).

Anything else is a ``TypeError`` at save time, naming where in the state it sits, rather than a checkpoint that
needs pickle to read. The disk tier loads DCP's non-tensor items with ``torch.load(weights_only=True)``
(:class:`SafeLoadPlanner`), which refuses anything but plain containers, numbers, strings, bytes and tensors.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.planner import ReadItem

_TAGS = ("__tensor__", "__ndarray__", "__tuple__", "__bytes__", "__dict__", "__dtype__")

#: the torch dtypes a state may name (by ``str(dtype)`` without ``torch.``)
_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in vars(torch).values() if isinstance(dtype, torch.dtype)}


def dumps(obj: Any) -> bytes:
    """``obj`` as UTF-8 JSON bytes (see the module docstring for what it may hold)."""
    return json.dumps(_encode(obj, "state"), allow_nan=True, separators=(",", ":")).encode()


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """The object :func:`dumps` wrote. Raises ``ValueError`` for anything that is not such JSON (e.g. a pickle)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            data = bytes(data).decode()
        except UnicodeDecodeError as err:
            raise ValueError("arc_engine state is not UTF-8 JSON (a checkpoint written by an older arc_engine, "
                             "with pickle, is not loaded)") from err
    try:
        return json.loads(data, object_hook=_decode)
    except json.JSONDecodeError as err:
        raise ValueError(f"arc_engine state is not valid JSON: {err}") from err


def _array_payload(array: np.ndarray) -> dict[str, Any]:
    array = np.ascontiguousarray(array)
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return {"dtype": array.dtype.str.lstrip("<>|="), "shape": list(array.shape),
            "data": base64.b64encode(little.tobytes()).decode("ascii")}


def _array_from(payload: dict[str, Any]) -> np.ndarray:
    dtype = np.dtype("<" + payload["dtype"]) if payload["dtype"][0] in "fiuc" else np.dtype(payload["dtype"])
    raw = base64.b64decode(payload["data"])
    return np.frombuffer(raw, dtype=dtype).reshape(payload["shape"]).astype(dtype.newbyteorder("="))


def _encode(obj: Any, where: str) -> Any:
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach().cpu().contiguous()
        if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits as int16
            payload = _array_payload(tensor.view(torch.int16).numpy())
            payload["dtype"] = "bfloat16"
        else:
            payload = _array_payload(tensor.numpy())
        return {"__tensor__": payload}
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            raise TypeError(f"arc_engine state: {where} is a numpy object array; it cannot be stored without pickle")
        return {"__ndarray__": _array_payload(obj)}
    if isinstance(obj, np.generic):
        return _encode(obj.item(), where)
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(k in _TAGS for k in obj):
            return {k: _encode(v, f"{where}.{k}") for k, v in obj.items()}
        return {"__dict__": [[_encode(k, f"{where} key"), _encode(v, f"{where}[{k!r}]")] for k, v in obj.items()]}
    raise TypeError(f"arc_engine state: {where} is a {type(obj).__module__}.{type(obj).__qualname__}, which is not "
                    "stored without pickle (JSON types, tuples, bytes, numpy arrays and tensors are)")


def _decode(obj: dict[str, Any]) -> Any:
    if len(obj) != 1:
        return obj
    (tag, value), = obj.items()
    if tag == "__tensor__":
        if value["dtype"] == "bfloat16":
            return torch.from_numpy(_array_from({**value, "dtype": "i2"}).copy()).view(torch.bfloat16)
        return torch.from_numpy(_array_from(value).copy())
    if tag == "__ndarray__":
        return _array_from(value).copy()
    if tag == "__tuple__":
        return tuple(value)
    if tag == "__bytes__":
        return base64.b64decode(value)
    if tag == "__dict__":
        return {_hashable(k): v for k, v in value}
    if tag == "__dtype__":
        if value not in _DTYPES:
            raise ValueError(f"arc_engine state: unknown torch dtype {value!r}")
        return _DTYPES[value]
    return obj


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a non-tensor item is read with ``torch.load(weights_only=True)``
    (DCP's default uses ``weights_only=False``: a crafted checkpoint could run code)."""

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as err:  # e.g. an UnpicklingError naming a global the safe loader refuses
            raise ValueError(f"{read_item.dest_index.fqn}: refused by the weights-only loader (only plain "
                             f"containers, numbers, strings, bytes and tensors are read): "
                             f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
