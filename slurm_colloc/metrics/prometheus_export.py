"""Per-job GPU metrics in Prometheus's text format, for node_exporter's textfile collector.

Sites watch Prometheus and Grafana, not colloc's node-local files. With
``prometheus_textfile`` set (colloc.conf), the node collector writes after every
sample one ``.prom`` file that node_exporter (``--collector.textfile.directory``)
serves with the node's own metrics: no extra port, no extra daemon, nothing
listening as root.

What is exported (names are the contract the dashboard in
``contrib/grafana/colloc-dashboard.json`` and docs/admin.md rely on):

* per running job and GPU, labels ``jobid``, ``user``, ``node``, ``gpu`` (Slurm's
  index) and ``uuid``: :data:`JOB_GAUGES` (shards, memory limit, memory used, the
  GPU's SM activity, utilisation and power, the attempt number) and
  ``colloc_job_verdict`` (1 per enforcement verdict on the attempt, labels ``kind``
  and ``action``). A job's series are in the file while the collector has the job
  open (seen on a GPU in the last ``GONE_AFTER_S``): they disappear when it ends.
* per node: ``colloc_verdicts`` (verdict records kept on the node, by kind and
  action), the counters ``colloc_gpu_oom_total`` and ``colloc_requeues_total``
  (bumped by the epilog: :mod:`.node_counters`), ``colloc_exporter_jobs`` and
  ``colloc_exporter_timestamp_seconds`` (staleness check).

What is read is root's own (metas, verdicts, counters) or what the collector just
sampled; nothing a user wrote. Labels are Slurm's job id, the owner's name from the
password database, and the GPU's identity. The file is written with a temp file and
a rename (:func:`.store.write_atomic`, 0644) so node_exporter never reads half of
it, in a directory that must be root's and writable by no one else: a directory a
user could write would let them swap the file or plant their own ``.prom`` files.
"""

from __future__ import annotations

import os
import pwd
import socket
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuBackend
from slurm_colloc.metrics import enforce, node_counters, store

Key = tuple[str, int]  # (job id, attempt)
Latest = Mapping[Key, Mapping[int, store.Row]]
"""The collector's latest row per (job, attempt) and Slurm GPU index."""

MIB = 1 << 20
JOB_LABELS = ("jobid", "user", "node", "gpu", "uuid")
"""``jobid``, not ``job``: Prometheus gives every scraped series the scrape's ``job``
label and would rename ours ``exported_job`` (jobstats' exporters say ``jobid`` too)."""
JOB_GAUGES: dict[str, str] = {
    "colloc_job_shards": "Shards (gres/shard) the job holds on this GPU.",
    "colloc_job_memory_limit_bytes": "GPU memory the job's shards allow (its MPS limit).",
    "colloc_job_memory_used_bytes": "GPU memory the job's processes use on this GPU.",
    "colloc_job_gpu_sm_activity_percent":
        "SM activity of the job's GPU (all its tenants; where measured).",
    "colloc_job_gpu_utilization_percent": "Utilisation of the job's GPU (all its tenants).",
    "colloc_job_gpu_power_watts": "Power draw of the job's GPU (all its tenants).",
    "colloc_job_attempt": "The job's attempt on this node (0: first run; n: n-th requeue).",
}
VERDICT_SCAN_S = 30.0
"""The node's verdict records are counted at most this often (one file each)."""
META_RETRY_S = 5.0
"""A job whose meta could not be read is retried after this long."""


@dataclass(frozen=True)
class JobFacts:
    """What the exporter labels and sizes a job by (from root's meta)."""

    uid: int
    shards: int
    limit_mib: int | None


def node_name() -> str:
    """The short host name (slurmd's NodeName on a usual site; per namespace on the lab)."""
    return socket.gethostname().split(".")[0]


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


class _Fixed(Collector):
    """A registry entry that yields metric families built beforehand."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


class TextfileExporter:
    """Builds the node's metric families and writes them to ``prometheus_textfile``."""

    def __init__(self, cfg: CollocConfig, backend: GpuBackend | None = None, *,
                 node: str | None = None, clock: Callable[[], float] = time.time,
                 user_of: Callable[[int], str] = _user_name) -> None:
        """Nothing is read or written until :meth:`write` (or :meth:`families`)."""
        self.cfg = cfg
        self.path = Path(cfg.prometheus_textfile)
        self.backend = backend
        self.node = node or node_name()
        self.clock = clock
        self.user_of = user_of
        self._users: dict[int, str] = {}
        self._facts: dict[Key, tuple[JobFacts | None, float]] = {}
        self._uuids: dict[int, str] | None = None
        self._verdicts: tuple[float, dict[tuple[str, str], int]] | None = None

    # ---------------------------------------------------------- inputs
    def _uuid(self, gpu: int) -> str:
        """The UUID of Slurm's GPU ``gpu`` ("" when the backend cannot say)."""
        if self._uuids is None:
            self._uuids = {}
            if self.backend is not None:
                from slurm_colloc.gpu.identity import GpuMap

                try:
                    self._uuids = {i: g.uuid for i, g in
                                   enumerate(GpuMap.from_backend(self.backend).gpus)}
                except Exception:  # noqa: BLE001 - labels only; the collector logs GPU errors
                    self._uuids = {}
        return self._uuids.get(gpu, "")

    def _job(self, k: Key) -> JobFacts | None:
        """The attempt's facts from root's meta (cached; a miss retried now and then)."""
        now = self.clock()
        hit = self._facts.get(k)
        if hit is not None and (hit[0] is not None or 0 <= now - hit[1] < META_RETRY_S):
            return hit[0]
        meta = store.read_meta(self.cfg.metrics_dir, k[0], k[1])
        facts = None if meta is None else JobFacts(meta.uid, meta.shards, meta.limit_mib)
        self._facts[k] = (facts, now)
        return facts

    def _user(self, uid: int) -> str:
        if uid not in self._users:
            if len(self._users) > 4096:
                self._users.clear()
            self._users[uid] = self.user_of(uid)
        return self._users[uid]

    def _verdict_counts(self) -> dict[tuple[str, str], int]:
        """(kind, action) -> verdict records on the node, rescanned every VERDICT_SCAN_S."""
        now = self.clock()
        if self._verdicts is None or not 0 <= now - self._verdicts[0] < VERDICT_SCAN_S:
            counts: dict[tuple[str, str], int] = {}
            for v in enforce.read_verdicts(self.cfg.metrics_dir):
                counts[(v.kind, v.action)] = counts.get((v.kind, v.action), 0) + 1
            self._verdicts = (now, counts)
        return self._verdicts[1]

    # ---------------------------------------------------------- families
    def families(self, latest: Latest) -> list[Metric]:
        """Every metric family for the jobs in ``latest`` and the node."""
        gauges = {n: GaugeMetricFamily(n, h, labels=JOB_LABELS) for n, h in JOB_GAUGES.items()}
        verdict = GaugeMetricFamily(
            "colloc_job_verdict", "An enforcement verdict on the job's attempt (1 each).",
            labels=(*JOB_LABELS, "kind", "action"))
        live = latest
        for k in sorted(live, key=lambda k: (store._job_key(k[0]), k[1])):
            facts = self._job(k)
            v = enforce.verdict_for(self.cfg, k[0], k[1]) if facts is not None else None
            for gpu, row in sorted(live[k].items()):
                labels = self._labels(k, gpu, facts)
                for name, value in self._values(k, row, facts):
                    gauges[name].add_metric(labels, value)
                if v is not None and v.gpu == gpu:
                    verdict.add_metric([*labels, v.kind, v.action], 1.0)
        for k in [k for k in self._facts if k not in latest]:
            del self._facts[k]  # ended: forget it
        return [*gauges.values(), verdict, *self._node_families(len(live))]

    def _labels(self, k: Key, gpu: int, facts: JobFacts | None) -> list[str]:
        user = self._user(facts.uid) if facts is not None else ""
        return [k[0], user, self.node, str(gpu), self._uuid(gpu)]

    @staticmethod
    def _values(k: Key, row: store.Row, facts: JobFacts | None) -> Iterator[tuple[str, float]]:
        """(metric, value) of one job's row; unmeasured values are left out, not 0."""
        if facts is not None:
            yield "colloc_job_shards", float(facts.shards)
            if facts.limit_mib is not None:
                yield "colloc_job_memory_limit_bytes", float(facts.limit_mib * MIB)
        yield "colloc_job_memory_used_bytes", row.mem_mib * MIB
        optional = (("colloc_job_gpu_sm_activity_percent", row.sm_pct),
                    ("colloc_job_gpu_utilization_percent", row.util_pct),
                    ("colloc_job_gpu_power_watts", row.power_w))
        for name, value in optional:
            if value is not None:
                yield name, float(value)
        yield "colloc_job_attempt", float(k[1])

    def _node_families(self, jobs: int) -> list[Metric]:
        node = [self.node]
        verdicts = GaugeMetricFamily(
            "colloc_verdicts", "Enforcement verdict records kept on the node (retention).",
            labels=("node", "kind", "action"))
        for (kind, action), n in sorted(self._verdict_counts().items()):
            verdicts.add_metric([*node, kind, action], float(n))
        counts = node_counters.read(self.cfg.metrics_dir)
        oom = CounterMetricFamily("colloc_gpu_oom", "GPU out-of-memory job ends the "
                                  "epilog found on the node.", labels=("node",))
        oom.add_metric(node, float(counts["gpu_oom"]))
        requeues = CounterMetricFamily("colloc_requeues", "Jobs the epilog requeued from "
                                       "the node (GPU OOM or MPS fault).", labels=("node",))
        requeues.add_metric(node, float(counts["requeues"]))
        njobs = GaugeMetricFamily("colloc_exporter_jobs", "Job attempts exported now.",
                                  labels=("node",))
        njobs.add_metric(node, float(jobs))
        ts = GaugeMetricFamily("colloc_exporter_timestamp_seconds",
                               "When the collector wrote this file (staleness check).",
                               labels=("node",))
        ts.add_metric(node, self.clock())
        return [verdicts, oom, requeues, njobs, ts]

    # ---------------------------------------------------------- output
    def text(self, latest: Latest) -> str:
        """The file's content (Prometheus text format 0.0.4)."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Fixed(self.families(latest)))
        return generate_latest(registry).decode()

    def write(self, latest: Latest) -> None:
        """Replace the file atomically (0644) in its checked directory."""
        checked_dir(self.path.parent)
        store.write_atomic(self.path, self.text(latest), mode=0o644)


def checked_dir(d: Path) -> Path:
    """``d``, created 0755 if missing; refused unless ours, a directory, not group- or
    world-writable (PermissionError): else a user could swap or add ``.prom`` files."""
    store.ensure_dir(d)
    st = os.lstat(d)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022:
        raise PermissionError(f"{d}: owned by uid {st.st_uid}, mode "
                              f"{stat.S_IMODE(st.st_mode):04o}: must be ours and writable "
                              "by no one else")
    return d
