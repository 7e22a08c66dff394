"""This rank's GPU's hardware events through NVML (``nvidia-ml-py``), for the R-Metric's λ.

Counted, per poll, as new events since the previous poll: ECC errors (corrected and uncorrected, volatile counters),
critical XID errors (an NVML event set, drained without waiting), and the onset of hardware slowdown (the thermal,
power-brake and hardware-slowdown clock-event reasons turning on). Optional: without ``pynvml`` or a CUDA device
nothing is polled; an NVML error disables polling with one warning and never reaches the training loop.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from arc_engine import internals

log = logging.getLogger("arc_engine")

#: Clock-event reason bits that mean the GPU slowed itself down (NVML's nvmlClocksEventReason* values).
SLOWDOWN_REASONS = 0x8 | 0x20 | 0x40 | 0x80  # HW slowdown, SW thermal, HW thermal, HW power brake
#: XID events read per poll at most (the rest wait for the next poll)
MAX_XID_PER_POLL = 64


def pci_bus_id(properties: object) -> str | None:
    """NVML's ``domain:bus:device.function`` address of a CUDA device from its torch properties (their integer
    ``pci_domain_id``, ``pci_bus_id``, ``pci_device_id``); None when torch does not give them. Pure."""
    parts = internals.cuda_pci_parts(properties)
    if not all(isinstance(part, int) for part in parts):
        return None
    domain, bus, device = parts
    return f"{domain:08X}:{bus:02X}:{device:02X}.0"


class HardwareEvents:
    """Polls one GPU (``device``). :meth:`poll` returns the events since the previous poll (0 when off)."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.nvml: Any = None
        self.handle: Any = None
        self.event_set: Any = None
        self._ecc: int | None = None
        self._slowed = False
        if not enabled or device.type != "cuda":
            return
        try:
            import pynvml
        except ImportError:
            log.info("arc_engine: nvidia-ml-py not installed; the R-Metric counts no NVML hardware events")
            return
        try:
            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            bus_id = pci_bus_id(torch.cuda.get_device_properties(index))
            # by PCI address: CUDA_VISIBLE_DEVICES renumbers CUDA devices but not NVML's
            self.handle = (pynvml.nvmlDeviceGetHandleByPciBusId(bus_id) if bus_id else
                           pynvml.nvmlDeviceGetHandleByIndex(index))
            self.nvml = pynvml
            self._ecc = self._ecc_total()
            try:
                self.event_set = pynvml.nvmlEventSetCreate()
                pynvml.nvmlDeviceRegisterEvents(self.handle, pynvml.nvmlEventTypeXidCriticalError, self.event_set)
            except pynvml.NVMLError:
                self.event_set = None  # XID events need privileges on some systems
        except Exception as error:
            log.warning("arc_engine: NVML unavailable (%s); the R-Metric counts no NVML hardware events", error)
            self.nvml = None

    @property
    def active(self) -> bool:
        return self.nvml is not None

    def _ecc_total(self) -> int | None:
        nvml = self.nvml
        try:
            return sum(int(nvml.nvmlDeviceGetTotalEccErrors(self.handle, kind, nvml.NVML_VOLATILE_ECC))
                       for kind in (nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED))
        except nvml.NVMLError:
            return None  # ECC off or not supported

    def poll(self) -> int:
        """New hardware events since the previous poll. Local; a few NVML calls (tens of microseconds)."""
        if self.nvml is None:
            return 0
        nvml, events = self.nvml, 0
        try:
            ecc = self._ecc_total()
            if ecc is not None and self._ecc is not None:
                events += max(ecc - self._ecc, 0)
            self._ecc = ecc
            for _ in range(MAX_XID_PER_POLL if self.event_set is not None else 0):
                try:
                    nvml.nvmlEventSetWait_v2(self.event_set, 0)
                except nvml.NVMLError:
                    break  # timeout: no pending event
                events += 1
            reasons = internals.nvml_clock_event_reasons(nvml, self.handle)
            slowed = bool(reasons & SLOWDOWN_REASONS)
            events += int(slowed and not self._slowed)
            self._slowed = slowed
        except Exception as error:
            log.warning("arc_engine: NVML polling failed (%s); the R-Metric stops counting NVML events", error)
            self.nvml = None
        return events
