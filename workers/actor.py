"""The GPU worker: loads the pipeline once, warms it up, then turns shards into stored images.

`GenerationWorker` is a plain class; the driver runs it as a Ray actor. One shard:
read its rows -> batch by bucket -> generate (one seeded generator per image) -> hand each image
to a bounded pool of encode+upload threads while the next batch computes -> when the last image
is durably stored, write the manifest create-only. That write is the shard's commit; a second
attempt of a committed shard sees it and discards its work.

Every run of a shard draws its own attempt token and writes its objects only under keys that
carry it (workers.output.layout), so a run never touches what another run stored: the committed
manifest's objects stay as they were, whatever a losing or late run does afterwards.

The shard queued behind the running one is prepared ahead (`prepare_ahead`, on a thread of its own:
workers.prefetch): its rows read, its per-shard inputs fetched and its first batch's prompts
encoded while this shard generates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from ditfleet.compile import PreparedPipeline, WarmupRuns, compile_count, prepare_worker_pipeline
from ditfleet.compile.config import first_compile_estimate_s
from ditfleet.compile.policy import resolve_auto
from ditfleet.model import LoraSpec, TextToImagePipeline, load_pipeline
from ditfleet.model.family import (
    load_text_encoder,
    model_family,
    model_max_sources,
    model_task,
    runs_scaled_gemms,
)
from ditfleet.workers.batch_fit import fit_batch_size
from ditfleet.workers.cache_secret import read_cache_secret
from ditfleet.workers.contract import ShardAbandoned, ShardResult, WorkerConfig
from ditfleet.workers.generate import (
    BatchGenerator,
    ImageRequest,
    encode_stream,
    image_requests,
    plan_batches,
    shard_prompts,
)
from ditfleet.workers.metrics import WorkerMetrics
from ditfleet.workers.output.formats import (
    ImageResult,
    ImageTask,
    ShardWriterConfig,
    StoredShard,
    make_shard_writer,
)
from ditfleet.workers.output.formats.base import ShardWriter
from ditfleet.workers.output.layout import manifest_key, new_attempt_token
from ditfleet.workers.output.manifest import ManifestRow, ManifestWriter, passthrough_json
from ditfleet.workers.output.provenance import JobProvenance
from ditfleet.workers.prefetch import PreparedShard, ShardPrefetch
from ditfleet.workers.quality_gate import ScoredImage, scored_images
from ditfleet.workers.rows import PromptRow, ShardSpec, read_shard_rows
from ditfleet.workers.scorers import build_scorers
from ditfleet.workers.source_prefetch import SourcePrefetch
from ditfleet.workers.sources import SourceReader, task_problem
from ditfleet.workers.spot import StopOnSigterm
from ditfleet.workers.startup_phase import COMPILING, LOADING, READY, publish_phase
from ditfleet.workers.storage import StoreConfigError, open_store
from ditfleet.workers.storage.input_files import filesystem_for
from ditfleet.workers.text_embeddings import PlacedTextEncoder
from ditfleet.workers.weights.digest import (
    check_identity,
    job_file_identities,
    local_identity,
    with_job_files,
)
from ditfleet.workers.weights.fetch import fetch_file, fetch_model


def resolve_device(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    dt = torch.bfloat16 if dtype == "bf16" or (dtype == "auto" and dev.type == "cuda") else torch.float32
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return dev, dt


def current_node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - outside a Ray worker there is no node to compare
        return None


def check_output_node(output_uri: str, output_node: str | None, here: str | None) -> None:
    """Refuse to write a node-local output from another node (see WorkerConfig.local_output_node)."""
    if output_node is None or here is None or here == output_node:
        return
    raise StoreConfigError(
        f"the output {output_uri} is a local path on the driver's node ({output_node[:12]}), and this "
        f"actor runs on another node ({here[:12]}): it would write images and manifests to its own "
        "disk. Use an s3:// output, or an absolute path on a filesystem every node mounts at the same "
        "place (then set output.shared_filesystem: true)"
    )


def worker_identity() -> str:
    actor = ""
    try:
        import ray

        if ray.is_initialized():
            actor = ":" + (ray.get_runtime_context().get_actor_id() or "")[:12]
    except Exception:  # noqa: BLE001 - identity is informational
        pass
    return f"{socket.gethostname()}:{os.getpid()}{actor}"


class GenerationWorker:
    def __init__(self, config: WorkerConfig) -> None:
        t0 = time.perf_counter()
        publish_phase(LOADING)  # placed: the driver stops saying it waits for resources
        self.config = config
        self.worker_id = worker_identity()
        self._stop = threading.Event()
        self.ahead = ShardPrefetch(self.prepare_shard)  # the next shard, prepared while one runs
        # Under Ray: SIGTERM (spot reclaim) abandons the running shard uncommitted, then exits.
        self._sigterm = StopOnSigterm(self.request_stop).install()
        self.metrics = WorkerMetrics(config.output_uri)
        # Storage first: a missing bucket or bad credentials fail before any model work.
        check_output_node(config.output_uri, config.local_output_node, current_node_id())
        self.store = open_store(config.output_uri, config.s3)
        self.store.check_writable()
        # An edit job's sources: one reader (its stores, its clients) for every shard.
        self.source_reader = (
            SourceReader(config.rows.source_limits, config.s3)
            if config.rows.image_column is not None
            else None
        )
        self.device, self.dtype = resolve_device(config.placement.device, config.placement.dtype)
        t_load = time.perf_counter()
        self.model = fetch_model(config.model_path, config.model_cache_dir, config.s3, config.model_fetch)
        if config.model_identity is not None:  # before loading: other weights never make an image here
            found = self.model.identity or local_identity(self.model.local_path, config.model_cache_dir)
            job_files = job_file_identities(config.loras, config.scheduler_config, config.s3)
            check_identity(config.model_identity, with_job_files(found, job_files), config.model_path)
        # Before loading: an edit job on a text-to-image model (or the other way round) whose
        # model_index.json only this node has read (a remote model) ends here, saying what to do.
        problem = task_problem(config.model_path, model_task(self.model.local_path), config.rows.image_column)
        if problem is not None:
            raise ValueError(problem)
        # Before loading: a GPU that fits no batch of the job's buckets fails here, not at batch 1.
        self.batch_fit = fit_batch_size(config, self.model.local_path, self.device, self.dtype)
        self.batch_size = self.batch_fit.batch_size
        self.pipe = self._load_pipeline(self.model.local_path)
        self.text = place_text_encoder(self.pipe, self.model.local_path, config)
        # Before compiling: a CLIP model that cannot be fetched or a model without the encoder
        # vqa asks fails the actor's start-up early. vqa reads the unwrapped encoder, wherever
        # the placement keeps it (workers.text_embeddings).
        self.scorers = build_scorers(
            config.scorer_names,
            text_encoder=self.text.encoder if self.text is not None else None,
            models=config.scorer_models(),
            cache_dir=config.model_cache_dir,
            s3=config.s3,
            fetch=config.model_fetch,
            device=self.device,
            dtype=self.dtype,
        )
        load_s = time.perf_counter() - t_load
        # Why the shared cache is off goes in the start-up report: the driver says it once per job.
        secret = read_cache_secret(config.compile_cache_key) if config.compile.shared_cache else None
        self.compile_report = self._compile(secret.key if secret is not None else None)
        # Its prompt length: the pipeline's settings; a row's most sources: the model's.
        self.generator = BatchGenerator(self.pipe, model_max_sources(self.model.local_path))
        self.prefetch: SourcePrefetch | None = None  # the running edit shard's sources
        shared_cache = "off"
        if secret is not None and (secret.key or self.compile_report.compile.methods):
            shared_cache = "on" if secret.key else f"off: {secret.off_reason}"
        self.startup = self._startup_report(load_s, shared_cache, time.perf_counter() - t0)
        publish_phase(READY)

    def _load_pipeline(self, local_path) -> TextToImagePipeline:
        """The pipeline from the node-local weights, adapters merged, on this actor's device."""
        config = self.config
        # Adapters and a schedule on S3 come to the node's cache like the weights.
        local = lambda src: str(fetch_file(src, config.model_cache_dir, config.s3, config.model_fetch))  # noqa: E731
        family = model_family(local_path)
        if family.name.startswith("diffusers:"):
            # diffusers' own pipeline class; its LoRA loader; every batch at the actor's size.
            return family.load_pipeline(
                local_path,
                device=self.device,
                dtype=self.dtype,
                settings=config.pipeline,
                model_id=config.model_path,
                model_revision=self.model.revision,
                batch_size=self.batch_size,
                loras=tuple(LoraSpec(local(a.path), a.scale) for a in config.loras),
                text_encoder=config.placement.text_encoder,
            )
        return load_pipeline(
            local_path,
            self.device,
            self.dtype,
            config.pipeline,
            model_id=config.model_path,
            loras=tuple(LoraSpec(local(a.path), a.scale) for a in config.loras),
            scheduler_config=local(config.scheduler_config) if config.scheduler_config else None,
            load_text_encoder_too=config.placement.text_encoder == "gpu",
        )

    def _compile(self, cache_secret: bytes | None) -> PreparedPipeline:
        """Compile and warm up every bucket the job uses, before the actor takes work."""
        config = self.config
        buckets = config.warmup_buckets or config.rows.buckets.names
        compile_config = resolve_auto(
            config.compile,
            self.device.type,
            config.expected_images,
            len(buckets),
            runs_scaled_gemms(self.pipe),
        )
        estimate_s = first_compile_estimate_s(self.device.type, bool(compile_config.dit))
        prepared = prepare_worker_pipeline(
            self.pipe,
            compile_config,
            [config.rows.buckets.get(b) for b in buckets],
            artifact_store=self.store,
            cache_secret=cache_secret,
            # A compiled DiT takes the batch size and text length as dynamic dimensions: one
            # batch of the configured size traces the graph every batch of 1..batch_size uses.
            runs=WarmupRuns(
                batch_sizes=(self.batch_size,) if compile_config.dit else (1,),
                max_sequence_length=config.pipeline.max_sequence_length,
            ),
            expected_images=config.expected_images,
            on_bucket=lambda i, n, name, first: publish_phase(
                COMPILING, bucket=i, buckets=n, name=name, first=first, estimate_s=estimate_s
            ),
        )
        # Under the 'table' modulation cache (a GPU's default) each bucket's schedule gets its
        # modulation now, once per actor, so no request computes any, with CFG or without.
        for b in buckets:
            bucket = config.rows.buckets.get(b)
            self.pipe.prefill_modulation(bucket.height, bucket.width, config.rows.steps)
        return prepared

    def _startup_report(self, load_s: float, shared_cache: str, startup_s: float) -> dict:
        """What the driver shows and sums about this actor's start-up."""
        warmup = self.compile_report.warmup
        return {
            "worker_id": self.worker_id,
            "pid": os.getpid(),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "model_id": self.pipe.model_id,
            "model_revision": self.pipe.model_revision,
            "loras": [{"path": a.path, "scale": a.scale} for a in self.config.loras],
            "model_fetch": self.model.to_dict(),
            "load_s": round(load_s, 3),
            "text_encoder": self.config.placement.text_encoder,
            "batch_size": self.batch_size,
            "batch_fit": self.batch_fit.to_dict(),
            "compile": self.compile_report.to_dict(),
            "shared_compile_cache": shared_cache,
            "warmup_s": warmup.seconds_per_bucket() if warmup else {},
            "startup_s": round(startup_s, 3),
        }

    # -- actor API -------------------------------------------------------------------------------

    def startup_report(self) -> dict:
        return dict(self.startup)

    def request_stop(self) -> None:
        self._stop.set()

    def prepare_ahead(self, shard: ShardSpec) -> bool:
        """Prepare `shard`, queued behind the running one, now (the driver calls this in the
        actor's `prefetch` concurrency group, so it runs beside run_shard); see workers.prefetch.
        False when it was not prepared: held already, running, or the worker is stopping."""
        if self._stop.is_set():
            return False
        return self.ahead.prefetch(shard)

    def prepare_shard(self, shard: ShardSpec) -> PreparedShard:
        """What a shard needs before its first batch: its rows and requests, its per-shard
        inputs (`prepare_inputs`), and, where the text encoder is free to (workers.text_embeddings
        `encode_ahead`), its first batch's prompts in the embedding cache. The same whether it runs
        ahead, on the prefetch thread, or at the start of run_shard."""
        t0 = time.perf_counter()
        rows = self.read_rows(shard)
        requests = image_requests(rows)
        inputs = self.prepare_inputs(shard, rows, requests)
        encoded = 0
        if self.text is not None and requests and self.source_reader is None:
            # An edit shard's prompts are encoded with their source images, not as text alone.
            first = plan_batches(requests, self.batch_size, self.generator.count_tokens)[0]
            stream = encode_stream(self.device)  # on CUDA, beside the denoising, not behind it
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                encoded = self.text.encode_ahead(
                    shard_prompts(first), self.config.pipeline.max_sequence_length
                )
        return PreparedShard(rows, requests, inputs, time.perf_counter() - t0, encoded)

    def read_rows(self, shard: ShardSpec) -> list[PromptRow]:
        """The shard's rows from its input file (only the row groups that hold them)."""
        fs = filesystem_for(
            shard.file, endpoint_url=self.config.s3.endpoint_url, region=self.config.s3.region
        )
        return read_shard_rows(shard, fs, self.config.rows, sources=self.source_reader)

    def prepare_inputs(
        self, shard: ShardSpec, rows: list[PromptRow], requests: list[ImageRequest]
    ) -> dict[str, object]:
        """The hook for per-shard inputs other than the rows (fetched ahead like them): none for
        a text-to-image job."""
        return {}

    def run_shard(self, shard: ShardSpec, attempt: int = 0) -> ShardResult:
        with self._sigterm.busy():
            try:
                return self._run_shard(shard, attempt)
            except ShardAbandoned:
                self.metrics.shard_finished("abandoned")
                raise

    def _run_shard(self, shard: ShardSpec, attempt: int) -> ShardResult:
        t0 = time.perf_counter()
        # The token carries the generation this run commits: its objects' keys say which
        # manifest key decides their fate (driver.output.orphans).
        token = new_attempt_token(attempt, shard.generation)
        result = ShardResult(
            shard.index,
            attempt,
            "committed",
            worker_id=self.worker_id,
            attempt_token=token,
            batch_size=self.batch_size,
        )
        if self._stop.is_set():  # queued behind the shard a stop request interrupted
            raise ShardAbandoned(f"shard {shard.index}: worker asked to stop before it started")
        if self.store.exists(manifest_key(shard.index, shard.generation)):
            result.status = "already_committed"
            return result
        try:
            prepared, result.input_wait_s, result.prefetched = self.ahead.take(shard)
            return self._run_prepared(shard, prepared, result, token, t0)
        finally:
            self.ahead.finished(shard)

    def _run_prepared(
        self, shard: ShardSpec, prepared: PreparedShard, result: ShardResult, token: str, t0: float
    ) -> ShardResult:
        rows, requests = prepared.rows, prepared.requests
        if self.text is not None and self.text.placement == "offload" and self.source_reader is None:
            # The encoder visits the GPU once per shard, here. Elsewhere each batch's prompts are
            # encoded on the generator's encode-next thread while the batch before runs, and the
            # first batch's were encoded ahead (prepare_shard): the device does not wait for them.
            # Not for an edit shard: its prompts are encoded with their source images.
            self.text.prefetch(shard_prompts(requests), self.config.pipeline.max_sequence_length)
        compiles_before, oom_splits_before = compile_count(), self.generator.oom_splits
        attention = model_family(self.pipe).attention_counters(self.pipe)
        attention_before = attention.to_dict()
        extras = [passthrough_json(req.row.extra) for req in requests]  # by ImageRequest.index
        made, stored = self._generate_and_store(shard.index, requests, extras, token)
        result.recompiles = compile_count() - compiles_before
        result.oom_splits = self.generator.oom_splits - oom_splits_before
        result.attention = attention.since(attention_before)
        manifest = ManifestWriter(shard.index, expected_rows=len(requests), generation=shard.generation)
        # The writer's results come in the order of its adds, which is the order `made` says.
        results = iter(stored.results)
        slots: list[ManifestRow | None] = [None] * len(requests)
        for scored, handed in made:
            row = self._manifest_row(scored, next(results) if handed else None, extras, result)
            slots[scored.image.request.index] = row
        rows_written = [row for row in slots if row is not None]
        assert next(results, None) is None and len(rows_written) == len(requests), "one row per image"
        for row in rows_written:
            manifest.add(row)
            _count(result, row)
        result.generate_s = sum(scored.image.generate_s for scored, _ in made)
        result.upload_s += stored.data_upload_s
        if not manifest.commit(self.store):
            # Another run committed first and its manifest names its own objects: ours are
            # orphans under our token. Deleting them touches nothing any manifest names.
            result.status = "already_committed"
            self._drop(stored.keys)
        self.metrics.shard_finished(result.status, rows_written if result.status == "committed" else ())
        result.rows = len(rows)
        result.wall_s = time.perf_counter() - t0
        return result

    @property
    def writer_config(self) -> ShardWriterConfig:
        """The job's writer settings and what every image's metadata names: the model loaded here
        and the job (made from `config` at each shard, so a changed config is followed)."""
        job = JobProvenance(
            self.pipe.model_id, self.pipe.model_revision, self.config.job_name, self.config.model_license
        )
        return dataclasses.replace(self.config.writer, job=job)

    def _generate_and_store(
        self, shard: int, requests: list[ImageRequest], extras: list[str | None], token: str
    ) -> tuple[list[tuple[ScoredImage, bool]], StoredShard]:
        """Generate every image of the shard, score it (quality.scorers; with quality.gate, its
        kept try: workers.quality_gate) and hand it to the shard writer as it comes (see
        `hand_over`); the writer's objects are all durably stored, and every score taken, when
        this returns (aborted on any error)."""
        writer = make_shard_writer(self.store, shard, self.writer_config, token)
        if self.source_reader is not None:  # read ahead of the device, per shard
            self.generator.sources = self.prefetch = SourcePrefetch(self.source_reader)
        try:
            made = scored_images(self.generator, requests, self.batch_size, self.scorers, self.config.gate)
            handed = hand_over(made, writer, extras, self._stop, shard, self._image_sources)
            return handed, writer.finish()
        except BaseException:
            writer.abort()
            raise
        finally:
            if self.text is not None:
                self.text.release()
            if self.prefetch is not None:
                self.prefetch.close()
                self.generator.sources = None

    # -- helpers ---------------------------------------------------------------------------------

    def _source_columns(self, row: PromptRow) -> tuple[tuple[str, ...] | None, tuple[str | None, ...] | None]:
        """An edit row's sources by URI and by the sha256 of the bytes read (None where one was
        not read: its row failed), for the manifest; (None, None) for a text job's row."""
        if self.prefetch is None or not row.sources:
            return None, None
        return tuple(s.uri for s in row.sources), self.prefetch.digests.of(row)

    def _image_sources(self, row: PromptRow) -> tuple[tuple[str, str], ...] | None:
        """What a made image's metadata names as its sources (each one was read to make it)."""
        uris, digests = self._source_columns(row)
        if uris is None or digests is None:
            return None
        return tuple((uri, digest or "") for uri, digest in zip(uris, digests))

    def _drop(self, keys: tuple[str, ...]) -> None:
        """Best-effort removal of a losing run's objects; what is left, the driver's cleanup or
        `ditfleet verify --clean` removes."""
        for key in keys:
            try:
                self.store.delete(key)
            except Exception:  # noqa: BLE001 - an orphan left behind is harmless
                return

    def _manifest_row(
        self, scored: ScoredImage, stored: ImageResult | None, extras: list[str | None], result: ShardResult
    ) -> ManifestRow:
        """The manifest row of one requested image, failures included; stored: the writer's result
        for it (None: not handed over, its generation failed)."""
        gen = scored.image
        req = gen.request
        row, k = req.row, req.k
        error = gen.error or (stored.error if stored is not None else "image was not stored")
        ok = gen.error is None and stored is not None and stored.ok
        source_uris, source_sha256 = self._source_columns(row)
        return ManifestRow(
            id=row.id,
            k=k,
            prompt=row.prompt,
            negative_prompt=row.negative_prompt,
            seed=row.seed,
            width=row.width,
            height=row.height,
            bucket=row.bucket,
            steps=row.steps,
            true_cfg_scale=float(row.true_cfg_scale),
            model_id=self.pipe.model_id,
            model_revision=self.pipe.model_revision,
            model_license=self.config.model_license,
            status="ok" if ok else "failed",
            error=None if ok else error,
            uri=stored.uri if ok and stored else None,
            sha256=stored.sha256 if ok and stored else None,
            bytes=stored.bytes if ok and stored else None,
            format=self.config.writer.image_format,
            generate_s=gen.generate_s,
            encode_s=stored.encode_s if stored else None,
            upload_s=stored.upload_s if stored else None,
            worker=self.worker_id,
            attempt=result.attempt,
            shard=result.shard,
            compile_fallback=bool(self.compile_report.fallbacks),
            recompiles=result.recompiles,
            extra=extras[req.index],
            step_cache=gen.step_cache,
            dit_blocks_computed=gen.blocks_computed,
            dit_blocks_reused=gen.blocks_reused,
            batch_size=self.batch_size,
            source_uris=source_uris,
            source_sha256=source_sha256,
            **scored.manifest_columns(stored_ok=ok),
        )


def image_task(
    req: ImageRequest, extra: str | None, sources: tuple[tuple[str, str], ...] | None = None
) -> ImageTask:
    """What the writer stores of one image next to its pixels; extra: the row's pass-through JSON;
    sources: an edit row's (uri, sha256) each, for the image's metadata."""
    row = req.row
    as_given = {
        name: getattr(row, name) for name in ("id", "num_images", "prompt", "negative_prompt", "steps")
    }
    # The image's own: its index, the seed it was made from (its try's), the row's JSON.
    return ImageTask(
        **as_given,
        k=req.k,
        seed=req.seed,
        extra=extra,
        true_cfg_scale=float(row.true_cfg_scale),
        sources=sources,
    )


def hand_over(
    made: Iterable[ScoredImage],
    writer: ShardWriter,
    extras: Sequence[str | None],
    stop: threading.Event,
    shard: int,
    sources: Callable[[PromptRow], tuple[tuple[str, str], ...] | None] | None = None,
) -> list[tuple[ScoredImage, bool]]:
    """The generator loop's side of the writer: each image as it comes out, with its host work
    (ScoredImage.host_work: scores and hash for the writer's threads), so that this thread goes
    straight back to the device. Returns every image in the order made, with whether it was
    handed over (a failed generation is not): the writer's results follow that order."""
    out: list[tuple[ScoredImage, bool]] = []
    for scored in made:
        if stop.is_set():
            raise ShardAbandoned(f"shard {shard}: worker asked to stop; nothing committed")
        image, pixels = scored.image, scored.image.pixels
        if pixels is not None:
            row = image.request.row
            task = image_task(image.request, extras[image.request.index], sources(row) if sources else None)
            writer.add(task, pixels.permute(1, 2, 0).numpy(), scored.host_work())  # (H, W, 3) uint8
            image.pixels = None  # the writer holds it now; keep shard memory flat
        out.append((scored, pixels is not None))
    return out


def _count(result: ShardResult, row: ManifestRow) -> None:
    """Add one manifest row to the shard result's counts and times."""
    if row.status == "ok":
        result.images_ok += 1
    else:
        result.images_failed += 1
        result.errors[row.error or "?"] = result.errors.get(row.error or "?", 0) + 1
    result.encode_s += row.encode_s or 0.0
    result.upload_s += row.upload_s or 0.0


def place_text_encoder(pipe, local_path, config: WorkerConfig) -> PlacedTextEncoder | None:
    """Put the pipeline's text encoder where the job says, behind the embedding cache.

    `gpu`: it was loaded next to the DiT. `cpu` and `offload`: it is loaded on the CPU here, so
    its weights never sit on the GPU next to the DiT's at start-up. None for a model without one.
    """
    placement = config.placement
    if getattr(pipe, "family", None) is not None:
        return None  # a diffusers pipeline encodes its own text, placed when it was loaded
    if placement.text_encoder != "gpu":
        pipe.text_encoder = load_text_encoder(local_path, "cpu", pipe.dtype)
    if pipe.text_encoder is None:
        return None
    placed = PlacedTextEncoder(
        pipe.text_encoder,
        placement.text_encoder,
        pipe.device,
        placement.embedding_cache_bytes,
        transformer=pipe.transformer,
    )
    pipe.text_encoder = placed
    return placed
