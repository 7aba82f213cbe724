"""Which kernel runs at which shape: linear.py for the GEMMs, attention.py for paged attention."""
