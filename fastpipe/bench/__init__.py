"""`fastpipe bench`: loader alone, model alone, both together — and which one limits training."""
