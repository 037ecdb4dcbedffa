"""Interchangeable loaders behind one contract; see `make_loader`."""
