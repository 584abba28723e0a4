"""EnvLoop pipelines: a disciplined self-improvement loop for typed decision models."""

__version__ = "0.1.0"
