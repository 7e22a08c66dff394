"""Where events and metrics go: console, JSONL files and W&B, behind one dispatcher."""

from arc_engine.sinks.base import Sink, SinkSet
from arc_engine.sinks.console import ConsoleSink, format_event
from arc_engine.sinks.jsonl import JsonlSink, read_jsonl
from arc_engine.sinks.wandb_sink import WandbSink

__all__ = ["ConsoleSink", "JsonlSink", "Sink", "SinkSet", "WandbSink", "format_event", "read_jsonl"]
