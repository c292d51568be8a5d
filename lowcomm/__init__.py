"""lowcomm: train one model on peers scattered over the internet with low-communication algorithms."""

__version__ = "0.1.0"
