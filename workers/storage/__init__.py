"""Where bytes are stored: the object store interface (base), a local directory (local), S3 (s3),
the store a URI names (open), and the prompt Parquet files as pyarrow reads them (input_files).

The names most callers need are importable from here (the key check and fsync helper from base);
s3.py (boto3) loads only when an s3:// store is opened.
"""

from ditfleet.workers.storage.base import ObjectNotFound, ObjectStore, S3Config, StoreConfigError, StoreError
from ditfleet.workers.storage.local import LocalStore
from ditfleet.workers.storage.open import open_store

__all__ = [
    "LocalStore",
    "ObjectNotFound",
    "ObjectStore",
    "S3Config",
    "StoreConfigError",
    "StoreError",
    "open_store",
]
