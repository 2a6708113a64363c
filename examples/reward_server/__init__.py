"""A stand-alone reward server: the example of swapping verst's reward service (see server.py)."""
