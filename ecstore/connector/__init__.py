"""vLLM connector (see issue: connector)."""
