"""How remote weights are downloaded and verified: the worker's knobs, without boto3.

The driver-worker contract (workers.contract) carries this config, and `ditfleet validate` /
`plan` import the contract: keeping it apart from the downloader keeps boto3 out of them.
"""

from __future__ import annotations

from dataclasses import dataclass

_MiB = 1024 * 1024


@dataclass(frozen=True)
class FetchConfig:
    """How remote weights are downloaded and verified."""

    chunksize: int = 16 * _MiB  # one ranged GET; a file of N bytes takes ceil(N / chunksize) GETs
    max_concurrency: int = 16  # ranged GETs in flight, over all files of the model
    # Objects at least this large go as ranged GETs when the client validates response checksums
    # (S3Config.response_checksum_validation="when_supported"); otherwise every object is fetched
    # in `chunksize` ranges from the first byte.
    multipart_threshold: int = 16 * _MiB
    download_attempts: int = 5  # per range, when its body breaks off mid-stream (s3transfer)
    verify_checksums: bool = True  # hash every download (MD5 ETag / stored checksum); size always
    verify_workers: int = 4  # files hashed at once, while later files download
    lock_timeout_s: float = 3600.0  # how long a second actor waits for the first one's download
    reserve_bytes: int = 0  # free disk to keep beyond the download (compile caches, outputs)

    def __post_init__(self) -> None:
        checks = [
            (self.chunksize >= 64 * 1024, "chunksize must be >= 64 KiB"),
            (self.max_concurrency >= 1, "max_concurrency must be >= 1"),
            (self.multipart_threshold >= 1, "multipart_threshold must be >= 1"),
            (self.download_attempts >= 1, "download_attempts must be >= 1"),
            (self.verify_workers >= 1, "verify_workers must be >= 1"),
            (self.lock_timeout_s > 0, "lock_timeout_s must be > 0"),
            (self.reserve_bytes >= 0, "reserve_bytes must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"FetchConfig: {message} (got {self!r})")
