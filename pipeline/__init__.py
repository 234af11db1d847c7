"""bulk-classify: offline bulk image classification from object storage to Parquet."""

__version__ = "0.1.0"
