"""Reading and writing objects: listing the source, fetching bytes, shard records and keys, writing and reading
the output's shards, their counts, and an Iceberg table as the output."""
