"""What the bytes mean: a converted data set's format. `dataset.json`'s schema (manifest.py; remote.py opens one in
a store), the tar, `.idx` and label layouts (shardformat.py), and the image header checks every decoder relies on
(imageguard.py). It imports the ground floor and the store layer below it, nothing above."""
