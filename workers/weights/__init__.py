"""Model weights on a node: fetching from a local path, S3 or a hub into the node cache (fetch,
which also makes the single files a job names next to its model local), S3 downloads
(download), the node cache itself (node_cache) and hub snapshots (hub)."""
