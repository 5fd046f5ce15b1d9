"""resihp: keeps hybrid-parallel LLM training at full speed through device failures."""

__version__ = "0.1.0"
