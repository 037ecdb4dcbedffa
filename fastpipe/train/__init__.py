"""Training (AMP loop, run folders) and GPU-memory accounting."""
