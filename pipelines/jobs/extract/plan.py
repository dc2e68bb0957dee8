"""The resource plan of an extraction job: how many replicas, with how many CPUs/GPUs each, on what device;
refusals that say what would fit."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import ray

from pipelines.jobs.extract.config import ExtractConfig
from pipelines.jobs.image_inputs import InputError
from pipelines.jobs.ray_runtime import local_cpu_count

log = logging.getLogger(__name__)

DECODE_CPUS = 0.25  # the reservation of each replica's decoder
# images a GPU replica's decoder reads and resizes at once: a 480x640 JPEG takes ~8-11 ms of CPU
# (issue 42), so one thread caps a replica near 100 images/s; a CPU replica's decoder keeps one, its
# cores are the replica's
GPU_DECODE_THREADS = 4


@dataclass
class Plan:
    workers: int
    cpus: float
    gpus: float
    threads: int
    device: str
    decode_threads: int = 1  # images each replica's decoder decodes at once


def plan_resources(cfg: ExtractConfig, local: bool) -> Plan:
    """Replica count and per-replica reservations that fit the cluster with room left for decoding.

    Every Ray actor reserves 1 CPU unless told otherwise; on a 2-core machine two such replicas would
    leave nothing for the decoders and the job would wait forever, so the reservations are computed
    (fractions allowed) and a request that cannot fit is refused up front. An actor lives on one node,
    so a reservation is also capped at what the largest node offers: on 2 nodes x 2 CPUs one replica
    gets 1.75 CPUs, not the 3.75 of the cluster's total that no node has.
    """
    resources = ray.cluster_resources()
    cpus = float(resources.get("CPU", local_cpu_count()))
    gpus = float(resources.get("GPU", 0))
    use_gpu = gpus > 0 and cfg.gpus_per_worker > 0
    node_cpus, node_gpus = _largest_node(cpus, gpus, cfg.gpus_per_worker if use_gpu else 0.0)
    largest = f"the largest node with {cfg.gpus_per_worker:g} GPU(s)" if use_gpu else "the largest node"
    if use_gpu:
        workers = cfg.workers or max(1, int(gpus // cfg.gpus_per_worker))
        per_cpu = cfg.cpus_per_worker if cfg.cpus_per_worker is not None else 1.0
        need_gpus = workers * cfg.gpus_per_worker
        if need_gpus > gpus:
            _refuse(
                f"{workers} replicas x {cfg.gpus_per_worker:g} GPU need {need_gpus:g} GPUs; "
                f"the cluster has {gpus:g}",
                local,
            )
        if cfg.gpus_per_worker > node_gpus:
            _refuse(
                f"a replica asks for {cfg.gpus_per_worker:g} GPUs but the largest node has {node_gpus:g}; "
                "lower --gpus-per-worker",
                local,
            )
    else:
        workers = cfg.workers or 1
        per_cpu = cfg.cpus_per_worker
        if per_cpu is None:
            share = min(cpus / workers, node_cpus) - DECODE_CPUS
            per_cpu = math.floor(share * 100) / 100
            if per_cpu <= 0:
                _refuse(f"{workers} CPU replicas do not fit in {cpus:g} CPUs; lower --workers", True)
    if workers * (per_cpu + DECODE_CPUS) > cpus + 1e-9:
        _refuse(
            f"{workers} replicas x ({per_cpu:g} CPUs + {DECODE_CPUS} for decoding) exceed the cluster's "
            f"{cpus:g} CPUs, so the job would wait forever; lower --workers or --cpus-per-worker "
            "(fractions allowed)",
            local,
        )
    if per_cpu > node_cpus + 1e-9:
        _refuse(
            f"a replica asks for {per_cpu:g} CPUs but {largest} has {node_cpus:g}, so it would "
            "wait forever; lower --cpus-per-worker (fractions allowed)",
            local,
        )
    threads = max(1, round(per_cpu))
    return Plan(
        workers,
        per_cpu,
        cfg.gpus_per_worker if use_gpu else 0.0,
        threads,
        "cuda" if use_gpu else "cpu",
        GPU_DECODE_THREADS if use_gpu else 1,
    )


def _alive_node_resources() -> list[dict]:
    return [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]


def _largest_node(cpus: float, gpus: float, gpus_per_worker: float) -> tuple[float, float]:
    """The most CPUs of an alive node that has `gpus_per_worker` GPUs, and the most GPUs of any.

    A replica needs both on one node: the CPUs of a head node without GPUs are no use to a GPU replica.
    Falls back to every node's CPUs when none has the GPUs (the GPU check refuses that), and to the
    cluster's totals when Ray lists no node.
    """
    alive = _alive_node_resources()
    if not alive:
        return cpus, gpus
    hosts = [r for r in alive if float(r.get("GPU", 0)) >= gpus_per_worker - 1e-9] or alive
    return max(float(r.get("CPU", 0)) for r in hosts), max(float(r.get("GPU", 0)) for r in alive)


def requested(plan: Plan) -> str:
    return (
        f"{plan.workers} replica(s) of {plan.cpus:g} CPU and {plan.gpus:g} GPU, "
        f"each with a {DECODE_CPUS:g} CPU decoder"
    )


def cluster_state() -> str:
    total = ray.cluster_resources()
    free = ray.available_resources()
    alive = _alive_node_resources()
    nodes = ", ".join(f"{r.get('CPU', 0):g} CPU/{r.get('GPU', 0):g} GPU" for r in alive[:8])
    more = f" and {len(alive) - 8} more" if len(alive) > 8 else ""
    return (
        f"the cluster has {total.get('CPU', 0):g} CPU and {total.get('GPU', 0):g} GPU on {len(alive)} "
        f"node(s) ({nodes}{more}), {free.get('CPU', 0):g} CPU and {free.get('GPU', 0):g} GPU free now"
    )


def _refuse(message: str, local: bool) -> None:
    if local:
        raise InputError(message)
    log.warning("%s; waiting for the autoscaler to add nodes", message)
