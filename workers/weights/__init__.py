"""Model weights on a node: fetching from a local path, S3 or a hub into the node cache (fetch),
S3 downloads (download), the node cache itself (node_cache), hub snapshots (hub) and single
files a job names next to its model (files)."""
