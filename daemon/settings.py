"""The daemon's own sections of maced.toml as dataclasses: [daemon], [server], [http], [feedback],
[admission], [finetune], [fleet]. Plain records with their defaults; `daemon/config.py` reads,
merges and checks them (the engine's, telemetry's, limits' and the fleet terms' live with their owners).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DaemonSettings:
    state_dir: str = ""  # "" = $MACE_STATE_DIR, systemd's $STATE_DIRECTORY, ~/.local/state/mace-edge
    log_level: str = "info"
    log_format: str = "auto"  # auto = journal under systemd, text otherwise


@dataclass(frozen=True)
class ServerSettings:
    ipc: str = "auto"  # socket path; "auto" = <runtime dir>/maced.sock; "" = no ipc endpoint
    tcp: str = ""  # e.g. tcp://127.0.0.1:5555; "" = no TCP endpoint
    tcp_without_curve: bool = False  # a loopback tcp endpoint without CURVE: only with this opt-in
    ipc_mode: str = "0660"  # socket file mode: owner and group may connect
    curve_secret_key: str = ""  # zmq certificate file with the server's secret key
    curve_authorized_keys: str = ""  # folder of clients' public-key certificates
    max_message_bytes: int = 1 << 20  # larger request frames are answered `too_large`
    max_inflight_per_client: int = 64
    max_inflight: int = 1024
    send_hwm: int = 100_000  # queued replies per client before it counts as not reading
    default_max_tokens: int = 256
    drain_timeout_s: float = 5.0  # on SIGTERM, how long running generations may finish
    admission_wait_s: float = 30.0  # longest a generate waits while admission says "queue"


@dataclass(frozen=True)
class HttpSettings:
    """The OpenAI-compatible HTTP gateway (daemon/fronts/http/, docs/gateway.md)."""

    bind: str = "127.0.0.1:8000"  # HOST:PORT ("[::1]:8000" for IPv6); "" = no HTTP endpoint
    api_keys: str = ""  # comma-separated bearer keys; any non-loopback bind requires keys
    api_key_file: str = ""  # a file with one key per line ('#' starts a comment)
    # Browser pages allowed to call the gateway (CORS), comma-separated origins such as
    # "https://app.example.com"; pages served from loopback (localhost, 127.0.0.1, [::1], any
    # port) always are. "*" allows any origin: only with API keys.
    cors_origins: str = ""
    allowed_hosts: str = ""  # Host names a loopback bind answers besides localhost/127.0.0.1/[::1]


@dataclass(frozen=True)
class FeedbackSettings:
    enabled: bool = True
    db_path: str = ""  # "" = <state_dir>/feedback.sqlite3


@dataclass(frozen=True)
class AdmissionSettings:
    enabled: bool = True
    telemetry: bool = True  # read telemetry at all (off: admission sees only queue length)


@dataclass(frozen=True)
class FineTuneSettings:
    enabled: bool = True  # continual DPO on consented users' preference pairs
    pairs_per_version: int = 4  # publish a new adapter version after this many trained pairs
    # Ignored since the engine's scheduler packs fine-tune stages beside inference (it used to
    # hold training back until inference had idled this long); kept so config files still load.
    idle_s: float = 1.0
    guard: bool = True  # publish only if held-out win rate / CLPD did not regress
    guard_prompts: int = 12  # held-out prompts answered greedily (in batches) to check degeneration (0: not checked)
    guard_tokens: int = 16  # tokens per answer (docs/training.md, "Degeneration")
    guard_kl_budget: float = 1.0  # mean KL(candidate || base) per answer token allowed (nats)
    guard_distinct_2_drop: float = 0.10  # largest fraction distinct-2 may fall below the base's
    guard_pairs: int = 16  # held-out pairs a candidate is judged on at most (0: all; docs/training.md)
    # Adapter versions a publish leaves on disk per user: the newest k, plus any rolled back to
    # and any a request is using (docs/training.md, "Retention"). Erasure removes all of them.
    keep_versions: int = 5
    # The users' trainers (docs/training.md, "The daemon's learning rate and beta"): AdamW's rate,
    # one step per trained example, and DPO's beta, chosen by tools/alignment_sweep.py (issue #32).
    learning_rate: float = 2e-4  # with rpo_alpha 4.0 (3e-4 with DPO alone, issue #32's first sweep)
    beta: float = 0.5
    # Weight of the chosen answer's per-token NLL beside DPO (RPO; docs/training.md, "Learning
    # without repeating"): teaches the edit in its context instead of the word in repetition.
    # 4, not the paper's 1: at 1 DPO's push on the user's own (rejected) answer outweighs the NLL
    # about 5:1 and answers drift to a generic reply ("Edits without collapse", issue #32).
    rpo_alpha: float = 4.0


@dataclass(frozen=True)
class FleetSettings:
    """This device's part in federated rounds of the shared fleet adapter (fleet.round,
    fleet.evaluate; docs/protocol.md). Off: both ops answer status "disabled"."""

    enabled: bool = False
    delta: float = 1e-5  # the delta at which epsilon is accounted over this device's rounds
    # Request frames of fleet.round / fleet.evaluate carry a whole adapter (a rank-8 q/k/v/o
    # adapter of SmolLM2-135M is 3.5 MiB): their own limit, the other ops keep server's.
    max_message_bytes: int = 64 << 20
    heldout_fraction: float = 0.2  # fleet.evaluate's split when the request does not give one


@dataclass(frozen=True)
class KeepAliveSettings:
    """[engine] keep_alive: how long an idle daemon keeps the model loaded (docs/keep_alive.md).
    Read beside the engine's own EngineConfig fields; the engine itself never sees it."""

    keep_alive: float = 300.0  # seconds; 0 = unload as soon as idle; -1 (any negative) = never
