"""Where the bytes are: the URL policy (urls.py), the stores' clients (clients.py), reads and uploads with one
bounded retry policy (remote.py), and the node-local shard cache with its files (cache.py, cachefiles.py). It
imports only the ground floor (errors, util, options): it knows bytes and byte ranges, not what they mean."""
