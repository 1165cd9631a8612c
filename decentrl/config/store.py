"""`[store]`: where versioned checkpoints live and how they are read and written.

`decentrl/store/checkpoints.py` (`CheckpointStore.from_config`) is the one reader: the trainer publishes
through it, workers and `decentrl eval` pull through it (`for_reader`), and the orchestrator
announces its URL to workers. docs/store.md explains every field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from decentrl.config.base import Section


class StoreConfig(Section):
    """Where versioned checkpoints live. Any fsspec URL; empty means `<run_dir>/checkpoints`.

    For s3:// the endpoint, region and credentials below override the usual AWS environment
    (AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE), which
    applies wherever they are left unset. See docs/store.md.
    """

    url: str = Field(
        "", description="fsspec URL (file:///dir, s3://bucket/prefix, ...); '' = <run_dir>/checkpoints "
        "(for a worker: the URL the orchestrator announces).",
    )
    keep_last: int = Field(
        8, ge=1, description="Versions kept by retention; raised to max_staleness + 2 if smaller."
    )
    retention_grace_s: float = Field(
        300.0, ge=0, description="A version is deleted only this long after a newer one was published "
        "(a worker may still be pulling it); make it longer than the slowest worker's pull.",
    )
    storage_options: dict[str, object] = Field(
        default_factory=dict, description="Extra fsspec filesystem options, e.g. {anon = true} for s3fs."
    )
    endpoint: str | None = Field(None, description="S3-compatible endpoint URL (MinIO, R2, ...); s3:// only.")
    region: str | None = Field(None, description="S3 region; s3:// only.")
    access_key_id: str | None = Field(
        None, description="S3 access key; s3:// only. Prefer the environment: the resolved config is written to the run dir."
    )
    secret_access_key: str | None = Field(None, description="S3 secret key, set together with access_key_id.")
    shard_size_mb: int = Field(
        128, ge=1, description="Largest safetensors shard; more shards upload and download in parallel."
    )
    upload_concurrency: int = Field(4, ge=1, le=64, description="Files uploaded at once by a publish.")
    publish_retry_s: float = Field(
        900.0, gt=0, le=86400, description="Trainer: a publish the store fails (unreachable, 503 SlowDown, a cut "
        "upload) is tried again, with a jittered back-off, for this long; then the trainer stops with the error. "
        "Training goes on meanwhile (a newer version replaces the one waiting).",
    )
    download_concurrency: int = Field(4, ge=1, le=64, description="Files downloaded at once by a pull.")
    parallel_reads: int = Field(
        32, ge=1, le=64, description="Remote stores: byte ranges of large files read at once by a pull, over all its "
        "files, each on its own connection (one TCP stream on a long lossy path carries a fraction of the link; "
        "K streams add up; docs/store.md measures them per link profile). On stores other than S3, files of "
        "256 KiB or less stream whole, download_concurrency at once. Local stores ignore it.",
    )
    part_mb: int = Field(
        8, ge=1, le=1024, description="Remote stores: the largest range (one request) of a file (on S3 any file, "
        "elsewhere one over 256 KiB), which is pulled as ranges of its size / parallel_reads (at least min_part_kb, "
        "at most this), each written in "
        "place as it arrives and recorded, so an interrupted pull fetches only the missing bytes. Near a file's "
        "end a slow range is split among the idle streams.",
    )
    min_part_kb: int = Field(
        256, ge=16, le=65536, description="Remote stores: the smallest range, so a file of a few parts is that many "
        "requests (larger where the store is slow to answer: a range is at least what one stream carries while a "
        "request waits, as the pull measures them). Smaller parts put more streams on a small file, which a long "
        "lossy link needs (the CPU demo's 1.1 MB delta on L2, 150 ms and 0.5% loss: 2.4 s in 256 KiB parts, "
        "1.1 s in 64 KiB), at more requests to the store (8 workers pulling 2.2 MB deltas from moto on 2 shared "
        "cores: delta p50 2.3 s in 256 KiB parts, 4.4 s in 64 KiB; docs/deploy.md).",
    )
    stall_timeout_s: float = Field(
        8.0, gt=0, le=600, description="Remote stores: a range read that receives no byte for this long (a silent "
        "drop, a stalled store) is abandoned and retried from where it stopped, after a jittered back-off. On S3 "
        "also the connect time-out, and a third of the read time-out (any request's wait for an answer, uploads "
        "included), unless storage_options.config_kwargs sets them.",
    )
    link_local: bool = Field(
        True, description="Local store on the cache's filesystem: pulls hard-link the verified files into "
        "the cache instead of copying them (zero copy). Off, or a public_key set: pulls always copy.",
    )
    cache_max_gb: float | None = Field(
        20.0, gt=0, description="Cap on a local pull cache; the oldest versions are evicted. None = no cap."
    )
    publish_dtype: Literal["fp32", "bf16", "fp16"] | None = Field(
        None, description="Dtype of the published weights (the trainer keeps float32 master weights); workers and "
        "the verifier load and sample in it. None: the model's own config dtype (a pretrained model's config.json "
        "dtype, float32 for the tiny model). bf16 halves every pull; see docs/store.md for the verifier tolerance.",
    )
    full_every: int = Field(
        8, ge=1, le=64, description="Full-model runs: every this many versions one is a key version (every file stored "
        "whole, and as a delta too, so workers holding the version before still fetch only the delta while a late "
        "joiner starts from the whole files); the others store each file as a delta against the version before "
        "(decentrl/store/delta.py), a small fraction of its bytes at RL learning rates. 1 = no deltas. LoRA runs "
        "publish adapters only.",
    )
    digest: Literal["blake3", "sha256"] = Field(
        "blake3", description="Digest the trainer writes into each new manifest. BLAKE3 hashes several times "
        "faster (verified pulls at copy speed); readers verify either, so older sha256 versions stay readable.",
    )
    signing_key: str = Field(
        "", description="Trainer: ed25519 private key file that signs every manifest ('' = unsigned)."
    )
    public_key: str = Field(
        "", description="Readers: ed25519 public key file; unsigned or wrongly signed versions are refused."
    )

    @model_validator(mode="after")
    def _parts(self) -> StoreConfig:
        if self.min_part_kb * 2**10 > self.part_mb * 2**20:
            raise ValueError(
                f"min_part_kb ({self.min_part_kb}) is larger than part_mb ({self.part_mb} MiB): set min_part_kb <= {self.part_mb * 1024}"
            )
        return self

    @model_validator(mode="after")
    def _s3_fields(self) -> StoreConfig:
        s3_only = {"endpoint": self.endpoint, "region": self.region, "access_key_id": self.access_key_id}
        used = [name for name, value in s3_only.items() if value is not None]
        if used and not self.url.startswith("s3://"):
            raise ValueError(f"{', '.join(used)} apply to s3:// URLs only (url is {self.url!r})")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("set access_key_id and secret_access_key together, or neither (then the AWS environment is used)")
        return self

    def fsspec_options(self) -> dict[str, object]:
        """storage_options for fsspec: `storage_options` plus the s3 fields that are set."""
        options = dict(self.storage_options)
        client_kwargs = dict(options.get("client_kwargs") or {})  # type: ignore[call-overload]
        if self.endpoint is not None:
            client_kwargs["endpoint_url"] = self.endpoint
        if self.region is not None:
            client_kwargs["region_name"] = self.region
        if client_kwargs:
            options["client_kwargs"] = client_kwargs
        if self.access_key_id is not None:
            options.update(key=self.access_key_id, secret=self.secret_access_key)
        if self.url.startswith("s3://"):
            # botocore pools 10 connections per client by default; a pull holds up to parallel_reads range
            # streams plus download_concurrency whole-file streams, and a range waiting for a
            # connection would count as stalled.
            config_kwargs = dict(options.get("config_kwargs") or {})  # type: ignore[call-overload]
            config_kwargs.setdefault("max_pool_connections", self.parallel_reads + self.download_concurrency)
            # botocore waits 60 s to connect and 60 s for each answer by default, and tries a request 5
            # times (its back-off also rides out SlowDown bursts), inside s3fs's own 5 tries, of which
            # CheckpointStore keeps 2: one read of a store that accepts and never answers took 197 s
            # at 2 s / 6 s time-outs with 5 x 5 tries. A publish caught by a silent 60 s partition came
            # back 55 s after the heal (faults.py F3S, 2026-11-29). So the stall bounds; the publish's
            # and the pull's own retries (logged, with their back-off) do the rest.
            config_kwargs.setdefault("connect_timeout", self.stall_timeout_s)
            config_kwargs.setdefault("read_timeout", 3 * self.stall_timeout_s)
            options["config_kwargs"] = config_kwargs
        return options

    def for_reader(self, url: str) -> StoreConfig:
        """This store as a reader uses it (a worker, `decentrl eval`): at `url`, and without the
        trainer's signing key, which only the trainer's machine holds."""
        return self.model_copy(update={"url": url, "signing_key": ""})
