"""Opening the ONNX Runtime session a cached start will ask for while the rest of the start runs:
a hint per model source (which graph, with which session options) written when a session opens,
and a thread that opens that session at the next start for `ort_session.open_session` to take.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from edge_runtime import durable
from edge_runtime.c_heap import give_heap_back as _give_heap_back

log = logging.getLogger(__name__)

HINTS_DIR = "prefetch"  # under the onnx cache dir
HINT_VERSION = 1
# engine.onnx_prefetch's variable, read before the config loads: the prefetch starts before the imports.
SETTING, ENV = "engine.onnx_prefetch", "MACE_ENGINE_ONNX_PREFETCH"
_OFF = ("0", "false", "no", "off")


def model_identity(spec: str | None) -> list:
    """The model source as `maced` knows it before loading anything: a path's real location, size,
    modification time and inode (a rewritten file is another model), else the name as given."""
    if spec:
        try:
            info = os.stat(spec)
        except OSError:
            return ["name", spec]
        return ["path", os.path.realpath(spec), info.st_size, info.st_mtime_ns, info.st_ino]
    return ["name", "default"]


def file_stamp(path: Path) -> list | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return [info.st_size, info.st_mtime_ns, info.st_ino]


def options_key(providers: list, num_threads: int, has_lora_inputs: bool, prepack: bool, arena: bool) -> dict:
    """The session options as a hint stores them (JSON: a provider's options tuple becomes a list)."""
    return json.loads(json.dumps({"providers": providers, "num_threads": int(num_threads),
                                  "has_lora_inputs": bool(has_lora_inputs), "prepack": bool(prepack),
                                  "arena": bool(arena)}))


class HintError(ValueError):
    """A hint that must not be acted on (corrupt, stale, or naming a graph outside the cache)."""


def _inside(path: Path, root: Path) -> Path:
    resolved = path.resolve()
    try:
        resolved.relative_to(root.resolve())
    except ValueError:
        raise HintError(f"{path} is outside {root}") from None
    return resolved


def _load_hint(hint_path: Path) -> Any:
    try:
        return json.loads(hint_path.read_text())
    except ValueError as exc:
        raise HintError(f"{hint_path}: {exc}") from None


def read_hint(onnx_dir: Path, identity: list) -> tuple[Path, dict, str]:
    """The graph path, options key and external data file name the hint for `identity` names,
    checked against the files now; raises HintError (or OSError: none) where it must not be opened."""
    hint_path = hint_file(onnx_dir, identity)
    hint = _load_hint(hint_path)
    if not isinstance(hint, dict) or hint.get("version") != HINT_VERSION or hint.get("identity") != identity:
        raise HintError(f"{hint_path}: not a hint for this model")
    graph = _inside(Path(str(hint.get("graph"))), onnx_dir)
    stamps = hint.get("stamps")
    if not isinstance(stamps, dict) or graph.name not in stamps or stamps != graph_stamps(graph):
        raise HintError(f"{graph} changed since the hint was written")
    options = hint.get("options")
    if not isinstance(options, dict) or set(options) != {"providers", "num_threads", "has_lora_inputs",
                                                         "prepack", "arena"} \
            or not isinstance(options["providers"], list) or not isinstance(options["num_threads"], int):
        raise HintError(f"{hint_path}: bad session options")
    data = hint.get("data")
    if not isinstance(data, str) or data not in stamps:  # a file beside the graph, by name
        raise HintError(f"{hint_path}: bad external data name")
    return graph, options, data


def opened_bytes(onnx_dir: Path, identity: list) -> int:
    """What an earlier start's own open of the hinted session added to resident memory, measured
    with nothing else loading beside it (0: not recorded)."""
    try:
        hint = _load_hint(hint_file(onnx_dir, identity))
    except (OSError, HintError):
        return 0
    value = hint.get("opened_bytes") if isinstance(hint, dict) else None
    return value if isinstance(value, int) and value > 0 else 0


def session_options(ort: Any, options: dict) -> Any:
    """ONNX Runtime's options for an options key: the same for a prefetched session as for one
    the engine opens itself (every graph optimisation)."""
    configs = ort.SessionOptions()
    configs.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if options["num_threads"]:
        configs.intra_op_num_threads = options["num_threads"]
    configs.enable_cpu_mem_arena = options["arena"]
    if not options["prepack"]:
        configs.add_session_config_entry("session.disable_prepacking", "1")
    return configs


def create_inference(graph: Path, options: dict, data: str, measure: bool = False) -> tuple[Any, int]:
    """An `InferenceSession` of `graph` with `options` (an options key), and with `measure` (the
    prefetch's thread) what opening it added to resident memory, the data file paged out while
    pre-packing reads it, as `ort_graphs.StepGraphs.session` does for the sessions it opens
    itself; else 0."""
    import onnxruntime as ort

    configs = session_options(ort, options)
    # ONNX Runtime takes a provider with options as a tuple only; JSON made it a list.
    providers = [tuple(p) if isinstance(p, list) else p for p in options["providers"]]
    if not measure:
        return ort.InferenceSession(str(graph), configs, providers=providers), 0
    from edge_runtime.model.mapped_weights import paging_out, resident_bytes

    before = resident_bytes()
    with paging_out(graph.parent / data):
        inference = ort.InferenceSession(str(graph), configs, providers=providers)
    # Conservative: the start's other threads (imports, the model's load) allocate meanwhile, and
    # their growth is counted as the session's too.
    after = resident_bytes()
    return inference, sum(max(0, a - b) for a, b in zip(after, before, strict=True)) if sum(before) else 0


def graph_stamps(graph: Path) -> dict:
    """The graph's and its folder's other files' (external data) size, mtime and inode: a graph
    rewritten in place is not the one a prefetched session opened."""
    folder = graph.parent
    return {entry.name: file_stamp(folder / entry.name) for entry in sorted(os.scandir(folder), key=lambda e: e.name)
            if entry.is_file(follow_symlinks=False)}


def hint_file(onnx_dir: Path, identity: list) -> Path:
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:24]
    return Path(onnx_dir) / HINTS_DIR / f"{key}.json"


class Prefetch:
    """One start's prefetch: the session it opens (or why not) and the hint it may write."""

    def __init__(self, onnx_dir: Path, identity: list) -> None:
        self.onnx_dir, self.identity = Path(onnx_dir), identity
        self.done = threading.Event()
        self.session: tuple[Any, int] | None = None  # `create_inference`'s, once opened
        self.key: tuple | None = None  # (graph path, options key, stamps) it was opened with
        self.remembered = False  # the first session this process opens is the one hinted
        self.thread: threading.Thread | None = None
        self.abandoned = False  # stopped while opening: the thread frees what it opened

    def start(self) -> None:
        self.thread = threading.Thread(target=self._open, name="ort-prefetch", daemon=True)
        self.thread.start()

    def _open(self) -> None:
        try:
            graph, options, data = read_hint(self.onnx_dir, self.identity)
            stamps = graph_stamps(graph)
            inference, grown = create_inference(graph, options, data, measure=True)
            # The thread's figure counts the start's concurrent growth too (torch's import alone is
            # hundreds of MiB): the ledger takes the figure a quiet open of this graph measured.
            grown = min(grown, opened_bytes(self.onnx_dir, self.identity) or grown)
            if self.abandoned:
                del inference
                _give_heap_back()
                return
            self.session, self.key = (inference, grown), (str(graph), options, stamps)
            log.debug("prefetched the onnxruntime session of %s (resident memory +%.0f MiB meanwhile)",
                      graph.parent.name, grown / 2**20)
        except FileNotFoundError:
            log.debug("no session prefetch hint for %s", self.identity)
        except Exception as exc:  # noqa: BLE001 - a failed prefetch only means the start opens it itself
            log.debug("session prefetch not used: %s", exc)
        finally:
            self.done.set()

    def take(self, path: Path, options: dict) -> tuple[Any, int] | None:
        """The prefetched `InferenceSession` and what opening it added to resident memory, when it
        was opened from exactly this graph with these options (waiting for it while it opens),
        else None, having dropped it first."""
        self.done.wait()
        session, key = self.session, self.key
        self.session = self.key = None
        if session is None:
            return None
        if key == (str(Path(path).resolve()), options, graph_stamps(Path(path))):
            return session
        log.debug("prefetched session of %s dropped: %s asked for", key[0] if key else None, path)
        del session
        _give_heap_back()
        return None

    def drop(self) -> None:
        """Free a session nobody took (the start is over; one still opening is freed when open)."""
        self.abandoned = True
        if self.done.is_set() and self.session is not None:
            self.session = self.key = None
            _give_heap_back()

    def remember(self, path: Path, options: dict, data: str, write: bool = True) -> None:
        """Write the hint for this model: the first session this process opens (`write` False: a
        taken session, which its hint already names)."""
        if self.remembered:
            return
        self.remembered = True
        if not write:
            return
        try:
            graph = _inside(Path(path), self.onnx_dir)
            target = hint_file(self.onnx_dir, self.identity)
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            durable.write_json(target, {"version": HINT_VERSION, "identity": self.identity, "graph": str(graph),
                                        "data": data, "stamps": graph_stamps(graph), "options": options})
        except (OSError, HintError) as exc:
            log.debug("no session prefetch hint written: %s", exc)

    def note_opened(self, path: Path, grown: int) -> None:
        """Add to this process's hint what opening its graph (not prefetched) added to resident
        memory, for the next start's prefetched session to report."""
        target = hint_file(self.onnx_dir, self.identity)
        try:
            hint = _load_hint(target)
            if not isinstance(hint, dict) or hint.get("graph") != str(Path(path).resolve()) or grown <= 0:
                return
            durable.write_json(target, {**hint, "opened_bytes": int(grown)})
        except (OSError, HintError) as exc:
            log.debug("no opened size added to the prefetch hint: %s", exc)


_current: Prefetch | None = None
_lock = threading.Lock()


def _on(value: Any) -> bool:
    return str(value).strip().lower() not in _OFF


def start_early(model_flag: str | None, set_items: list[str], environ: dict) -> Prefetch | None:
    """Start before the config loads, from what the command line and the environment already say
    (the model, engine.onnx_prefetch, engine.onnx_cache_dir); `settle` corrects it once loaded."""
    sets = dict(item.partition("=")[::2] for item in set_items)
    sets = {k.strip(): v for k, v in sets.items()}
    if not _on(sets.get(SETTING, environ.get(ENV, "1"))):
        return None
    spec = model_flag or sets.get("engine.model") or environ.get("MACE_ENGINE_MODEL") or environ.get("MACE_MODEL")
    if not spec:
        return None  # a model the config file names is known only once it loads
    from edge_runtime import paths

    onnx_dir = sets.get("engine.onnx_cache_dir") or environ.get("MACE_ENGINE_ONNX_CACHE_DIR") \
        or paths.cache_dir() / "onnx"
    return start(spec, onnx_dir)


def settle(engine: Any) -> None:
    """With the loaded engine config: stop a prefetch it rules out or that guessed another model or
    cache, and start one not started yet."""
    from edge_runtime import paths

    wanted = bool(engine.onnx_prefetch) and engine.backend in ("auto", "onnxruntime")
    onnx_dir = Path(engine.onnx_cache_dir) if engine.onnx_cache_dir else paths.cache_dir() / "onnx"
    now = _current
    if now is not None and (not wanted or now.identity != model_identity(engine.model) or now.onnx_dir != onnx_dir):
        stop()
    if wanted:
        start(engine.model, onnx_dir)


def start(spec: str | None, onnx_dir: str | Path) -> Prefetch:
    """Start opening the hinted session of model `spec` (once per process; later calls return the
    first one)."""
    global _current
    with _lock:
        if _current is None:
            _current = Prefetch(Path(onnx_dir), model_identity(spec))
            _current.start()
        return _current


def current() -> Prefetch | None:
    return _current


def stop() -> None:
    """Forget this process's prefetch, freeing a session nobody took."""
    global _current
    with _lock:
        if _current is not None:
            _current.drop()
        _current = None
