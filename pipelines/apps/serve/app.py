"""The FastAPI application: JSON endpoints over the detector and models, the static page, errors as JSON."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from pathlib import Path

import numpy as np
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from extraction import ImageError
from extraction.draw import region_label
from extraction.preprocess import decode_bytes, load_resized
from pipelines.apps.generate.rerank import rank
from pipelines.apps.generate.sample import SampleSettings, prompt_cut, prompt_unknown
from pipelines.apps.serve.backend import Backend
from pipelines.apps.serve.config import ServeConfig
from pipelines.apps.serve.decode_budget import DecodeBudget
from pipelines.apps.serve.freed_memory import give_back_freed_memory
from pipelines.apps.serve.generation import SERVER_RERANKERS, png_data_url
from pipelines.apps.serve.service import Service, ServiceError
from pipelines.apps.serve.upload_limit import UploadLimit
from storage import RegionFeatures

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
MAX_BEAM_SIZE = 20
DEFAULT_SAMPLES = 4  # images per prompt when the request does not say
MAX_SAMPLES = 16
MAX_SEED = 2**32 - 1  # torch generators take more, `xmodal generate sample --seed` no more


def create_app(backend: Backend, config: ServeConfig | None = None) -> FastAPI:
    """The application serving `backend`; its workers stop when the application shuts down."""
    config = config or ServeConfig()
    service = Service(backend, config)
    budget = DecodeBudget(int(config.max_decode_mb * 2**20), config.timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        service.close()

    # no /docs: FastAPI's documentation page loads its scripts from a CDN and the server must work offline
    app = FastAPI(title="xmodal", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service
    app.add_middleware(
        UploadLimit, max_bytes=int(config.max_upload_mb * 2**20), body_seconds=config.body_timeout_s
    )
    _add_error_handlers(app)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    @app.get("/api/health")
    async def health() -> dict:
        return {
            "status": "ok",
            **backend.describe(),
            "queue": {"pending": service.pending, "max_pending": config.max_pending},
            "decoding": {
                "budget_mb": config.max_decode_mb,
                "in_use_mb": budget.used / 2**20,
                "waiting": budget.waiting,
            },
            "batching": {
                "max_batch": config.max_batch,
                "max_wait_ms": config.max_wait_ms,
                "detector_calls": service.detector.calls,
                "images": service.detector.items,
            },
        }

    @app.post("/api/regions")
    async def regions(image: UploadFile = File(...)) -> dict:
        with service.admitted():
            started = time.perf_counter()
            bgr, name, size = await _decode(image, backend, budget)
            found = await service.run(service.regions(bgr, name, size))
            return {
                "image": _image_json(found, name),
                "regions": [_region_json(found, i, backend) for i in range(found.num_boxes)],
                "seconds": time.perf_counter() - started,
            }

    @app.post("/api/ask")
    async def ask(
        image: UploadFile = File(...), question: str = Form(...), top_k: int | None = Form(None)
    ) -> dict:
        if backend.answerer is None:
            raise ServiceError(
                501,
                "this server holds no question-answering model, only a captioner: use /api/caption, or "
                "start `xmodal serve` with --checkpoint a VQA/GQA model",
            )
        question = _check_question(question, config)
        top_k = config.top_k if top_k is None else top_k
        if not 1 <= top_k <= 100:
            raise ServiceError(400, f"top_k must be between 1 and 100, got {top_k}")
        with service.admitted():
            started = time.perf_counter()
            bgr, name, size = await _decode(image, backend, budget)
            found, answered = await service.run(service.ask(bgr, name, size, question, top_k))
            order = np.argsort(-answered.attention, kind="stable")[: config.attended]
            regions = [_region_json(found, i, backend) for i in range(found.num_boxes)]
            for entry, weight in zip(regions, answered.attention.tolist(), strict=True):
                entry["attention"] = weight
            best, score = answered.answers[0]
            return {
                "question": question,
                "answer": best,
                "score": score,
                "answers": [{"answer": a, "score": s} for a, s in answered.answers],
                "image": _image_json(found, name),
                "regions": regions,
                "attended": [int(i) for i in order],
                "seconds": time.perf_counter() - started,
            }

    @app.post("/api/caption")
    async def caption(image: UploadFile = File(...), beam_size: int | None = Form(None)) -> dict:
        if backend.captioner is None:
            raise ServiceError(
                501,
                "this server holds no captioner: start `xmodal serve` with --caption-checkpoint a "
                "captioning model (runs/caption/best), or use /api/ask",
            )
        beam_size = config.beam_size if beam_size is None else beam_size
        if not 1 <= beam_size <= MAX_BEAM_SIZE:
            raise ServiceError(400, f"beam_size must be between 1 and {MAX_BEAM_SIZE}, got {beam_size}")
        with service.admitted():
            started = time.perf_counter()
            bgr, name, size = await _decode(image, backend, budget)
            found, captioned = await service.run(service.caption(bgr, name, size, beam_size))
            words = []
            for word, weights in zip(captioned.words, captioned.attentions, strict=True):
                order = np.argsort(-weights, kind="stable")[: config.attended]
                words.append(
                    {"word": word, "attention": weights.tolist(), "attended": [int(i) for i in order]}
                )
            return {
                "caption": captioned.caption,
                "words": words,
                "beam_size": beam_size,
                "image": _image_json(found, name),
                "regions": [_region_json(found, i, backend) for i in range(found.num_boxes)],
                "seconds": time.perf_counter() - started,
            }

    @app.post("/api/generate")
    async def generate(
        prompt: str = Form(...),
        n: int = Form(DEFAULT_SAMPLES),
        seed: int = Form(0),
        top_k: int | None = Form(None),
        top_p: float | None = Form(0.9),
        temperature: float = Form(1.0),
        rerank: str | None = Form(None),
        guidance: float = Form(1.0),
    ) -> dict:
        generator = backend.generator
        if generator is None:
            raise ServiceError(
                501,
                "this server holds no text-to-image model: start `xmodal serve` with --generate-checkpoint "
                "a `xmodal generate train` run",
            )
        prompt = _check_text(prompt, config, "prompt", "describe the picture to draw")
        if not 1 <= n <= MAX_SAMPLES:
            raise ServiceError(400, f"n must be between 1 and {MAX_SAMPLES}, got {n}")
        if top_k is not None and top_k < 1:
            raise ServiceError(400, f"top_k must be at least 1, got {top_k}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ServiceError(400, f"top_p must lie in (0, 1], got {top_p}")
        if not temperature > 0:
            raise ServiceError(400, f"temperature must be positive, got {temperature}")
        if not 0 <= guidance <= 100:
            raise ServiceError(400, f"guidance must lie in [0, 100], got {guidance}")
        if not 0 <= seed <= MAX_SEED:
            raise ServiceError(400, f"seed must lie in [0, {MAX_SEED}], got {seed}")
        rerank = rerank or ("captioner" if backend.captioner is not None else "likelihood")
        if rerank not in SERVER_RERANKERS:
            raise ServiceError(400, f"rerank must be one of {', '.join(SERVER_RERANKERS)}, got {rerank!r}")
        if rerank == "captioner" and backend.captioner is None:
            raise ServiceError(
                400, "rerank 'captioner' needs a captioner: start `xmodal serve` with --caption-checkpoint"
            )
        reranker = {
            "likelihood": "likelihood: the transformer's log p(image tokens | prompt)",
            "none": "none: the sampling order",
        }.get(rerank)
        if reranker is None:
            held = backend.captioner
            reranker = (
                f"captioner {held.tuned.settings.get('arch')} {held.checkpoint}: log p(prompt | regions)"
            )
        try:
            unknown = prompt_unknown(generator.model, prompt)
        except ValueError as exc:
            raise ServiceError(400, str(exc)) from None
        cut = prompt_cut(generator.model, prompt)
        with service.admitted():
            started = time.perf_counter()
            settings = SampleSettings(n, top_k, top_p, temperature, seed, guidance)
            images, scores = await service.run(service.generate(prompt, settings, rerank))
            return {
                "prompt": prompt,
                "rerank": rerank,
                "reranker": reranker,
                "seed": seed,
                "guidance": guidance,
                "prompt_cut": cut,
                "prompt_unknown": unknown,
                "images": [
                    {
                        "sample": i,
                        "score": float(scores[i]) if math.isfinite(float(scores[i])) else None,
                        "png": png_data_url(images[i]),
                    }
                    for i in rank(scores)
                ],
                "seconds": time.perf_counter() - started,
            }

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as {"error": message} with its status; tracebacks stay in the server log."""

    @app.exception_handler(ServiceError)
    async def service_error(_request: Request, exc: ServiceError) -> JSONResponse:
        return JSONResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        return JSONResponse(
            {"error": f"bad request ({problems}); send multipart/form-data with the fields the API names"},
            status_code=400,
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(
            {"error": f"internal error ({type(exc).__name__}: {exc}); see the server log"}, 500
        )


async def _decode(
    upload: UploadFile, backend: Backend, budget: DecodeBudget
) -> tuple[np.ndarray, str, tuple[int, int]]:
    """The upload at the detector's working size, its name and its original (h, w): decoded within the
    budget, which is held from the header's size until the full-size pixels are gone."""
    if backend.detector is None:
        raise ServiceError(
            501,
            "this server holds only a text-to-image model: use /api/generate, or start `xmodal serve` with "
            "--checkpoint or --caption-checkpoint",
        )
    name = upload.filename or "upload"
    data = await upload.read()
    try:
        cost = decode_bytes(data, name, *backend.working_size)
        await budget.acquire(cost, name)
        loop = asyncio.get_running_loop()

        def decode() -> tuple[np.ndarray, tuple[int, int]]:
            try:
                return load_resized(data, name, *backend.working_size)
            finally:  # in the worker: a request cancelled meanwhile does not free what is still decoding
                give_back_freed_memory()
                loop.call_soon_threadsafe(budget.release, cost)

        bgr, size = await run_in_threadpool(decode)
        return bgr, name, size
    except ImageError as exc:
        # extraction's advice is about an input folder ("remove it"); an upload is fixed by sending another
        reason = re.sub(r"; (re-download or )?remove it( from the input)?$", "", str(exc))
        raise ServiceError(400, f"{reason}; upload another image (JPEG, PNG, ...)") from None


def _check_question(question: str, config: ServeConfig) -> str:
    return _check_text(question, config, "question", "type a question about the image")


def _check_text(text: str, config: ServeConfig, what: str, hint: str) -> str:
    text = text.strip()
    if not text:
        raise ServiceError(400, f"the {what} is empty; {hint}")
    if len(text) > config.max_question_chars:
        raise ServiceError(
            400, f"the {what} has {len(text)} characters, above the {config.max_question_chars} limit"
        )
    return text


def _image_json(regions: RegionFeatures, name: str) -> dict:
    return {"name": name, "width": regions.img_w, "height": regions.img_h}


def _region_json(regions: RegionFeatures, i: int, backend: Backend) -> dict:
    return {
        "box": [round(float(v), 2) for v in regions.boxes[i]],
        "label": region_label(regions, i, backend.object_names, backend.attr_names),
        "object_id": int(regions.objects_id[i]),
        "object_score": float(regions.objects_conf[i]),
        "attribute_id": int(regions.attrs_id[i]),
        "attribute_score": float(regions.attrs_conf[i]),
    }
