"""The one-time conversion: raw photos → WebDataset shards + dataset.json + rejected.jsonl + previews."""
