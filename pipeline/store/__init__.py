"""Everything on disk: schemas (package data), atomic writes, the manifest, the
run/shard model with its checks and readers, and the bin-table store."""
