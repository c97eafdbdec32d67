"""agent-flywheel: traces in, a better and cheaper agent model out, every step tracked, versioned and gated."""

__version__ = "0.1.0"
