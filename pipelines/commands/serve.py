"""`xmodal serve --checkpoint DIR [--caption-checkpoint DIR] [--generate-checkpoint RUN]`: the page and JSON
API that answer questions about uploaded images, describe them, and draw images for a prompt."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipelines.apps.serve.config import ServeConfig
    from pipelines.engine.devices import DEFAULT_DEVICE, DEVICE_HELP

    d = ServeConfig()
    parser.add_argument(
        "--checkpoint", help="fine-tuned VQA/GQA directory (runs/vqa/best), or a captioning one"
    )
    parser.add_argument(
        "--caption-checkpoint",
        metavar="DIR",
        help="fine-tuned captioning directory (runs/caption/best) for /api/caption beside --checkpoint",
    )
    parser.add_argument(
        "--generate-checkpoint",
        metavar="RUN",
        help="a `xmodal generate train` run (DALL-E) for the page's Generate tab and /api/generate; with "
        "a captioner the samples are re-ranked by its likelihood of the prompt, else by the transformer's",
    )
    parser.add_argument(
        "--detector",
        metavar="WEIGHTS",
        help="detector checkpoint; default: the one the training features were made with if it exists, "
        "else random weights (meaningless regions, for tests)",
    )
    parser.add_argument(
        "--vocab",
        metavar="DIR",
        help='VG objects_vocab.txt and attributes_vocab.txt, for "attribute object" labels',
    )
    parser.add_argument(
        "--host", default=d.host, help=f"address to listen on (default: {d.host}, this machine only)"
    )
    parser.add_argument("--port", type=int, default=d.port, help=f"(default: {d.port})")
    parser.add_argument("--device", default=DEFAULT_DEVICE, help=DEVICE_HELP)
    parser.add_argument("--min-size", type=int, help="detector input shortest side (default: as recorded)")
    parser.add_argument("--max-size", type=int, help="detector input longest side (default: as recorded)")
    parser.add_argument(
        "--max-batch",
        type=int,
        default=d.max_batch,
        help=f"images per detector call (default: {d.max_batch}; 1 = no batching)",
    )
    parser.add_argument(
        "--max-wait-ms",
        type=float,
        default=d.max_wait_ms,
        help=f"how long an image waits for others to share its detector call (default: {d.max_wait_ms:g})",
    )
    parser.add_argument(
        "--max-pending",
        type=int,
        default=d.max_pending,
        help=f"requests in flight before new ones get 503 (default: {d.max_pending})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=d.timeout_s,
        help=f"seconds before a request gets 504 (default: {d.timeout_s:g})",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=d.request_timeout_s,
        help="seconds a client has to send a whole request, headers and body, from its first byte; a "
        f"slower one gets 408 and is disconnected (default: {d.request_timeout_s:g})",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help=f"connections held at once, slow clients included; more get 503 (default: {d.max_connections})",
    )
    parser.add_argument(
        "--max-upload-mb",
        type=float,
        default=d.max_upload_mb,
        help=f"largest upload (default: {d.max_upload_mb:g})",
    )
    parser.add_argument(
        "--max-decode-mb",
        type=float,
        default=d.max_decode_mb,
        help="memory all uploads being decoded may hold at once, about 17 bytes per decoded pixel (a 50 MP "
        "PNG or WebP: ~790 MiB; a JPEG is decoded at the detector's working size); more wait their turn "
        f"and get 503 after --timeout, one image above it 413 (default: {d.max_decode_mb:g})",
    )
    parser.add_argument("--top-k", type=int, default=d.top_k, help=f"answers returned (default: {d.top_k})")
    parser.add_argument(
        "--beam-size", type=int, default=d.beam_size, help=f"caption beam width (default: {d.beam_size})"
    )


def run(args: argparse.Namespace) -> int:
    from pipelines.apps.serve import backend as models
    from pipelines.apps.serve.app import create_app
    from pipelines.apps.serve.config import ServeConfig
    from pipelines.apps.serve.http_server import make_server

    try:
        config = ServeConfig(
            host=args.host,
            port=args.port,
            max_batch=args.max_batch,
            max_wait_ms=args.max_wait_ms,
            max_pending=args.max_pending,
            timeout_s=args.timeout,
            request_timeout_s=args.request_timeout,
            max_connections=args.max_connections,
            max_upload_mb=args.max_upload_mb,
            max_decode_mb=args.max_decode_mb,
            top_k=args.top_k,
            beam_size=args.beam_size,
        )
        backend = models.load_backend(
            args.checkpoint,
            args.detector,
            args.device,
            args.vocab,
            args.caption_checkpoint,
            generate_checkpoint=args.generate_checkpoint,
            min_size=args.min_size,
            max_size=args.max_size,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"xmodal serve: {exc}", file=sys.stderr)
        return 1
    if not _is_loopback(config.host):
        log.warning("listening on %s: anyone who can reach this address can use the server", config.host)
    log.info("open http://%s:%d/ in a browser", config.host, config.port)
    make_server(create_app(backend, config), config).run()
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
