"""Where events and metrics go: console, JSONL files, and (later) W&B, behind one dispatcher."""

from arc_engine.sinks.base import Sink, SinkSet
from arc_engine.sinks.console import ConsoleSink, format_event
from arc_engine.sinks.jsonl import JsonlSink, read_jsonl

__all__ = ["ConsoleSink", "JsonlSink", "Sink", "SinkSet", "format_event", "read_jsonl"]
