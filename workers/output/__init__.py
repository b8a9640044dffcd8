"""What a job writes: the key layout, the manifest, the image codec, the upload pool and the
output formats (formats/)."""
