"""How `maced` imports what it serves with: `import daemon.main` alone stays light (the parser,
logging), and `main()` imports torch, the config, the service and both fronts with the cyclic
collector paused, freezes what they made and leaves the collector as it found it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_daemon_main_imports_neither_torch_nor_the_service():
    got = _run("import json, sys\n"
               "import daemon.main\n"
               "print(json.dumps({m: m in sys.modules for m in ('torch', 'daemon.config', 'daemon.service')}))\n")
    assert got == {"torch": False, "daemon.config": False, "daemon.service": False}


def test_serving_modules_are_imported_with_the_collector_paused_and_then_frozen():
    got = _run("import gc, json, sys\n"
               "import daemon.main\n"
               "seen = []\n"
               "gc.callbacks.append(lambda phase, info: seen.append(info['generation']))\n"
               "daemon.main.import_serving_modules()\n"
               "print(json.dumps({'collections': len(seen), 'enabled': gc.isenabled(),\n"
               "                  'frozen': gc.get_freeze_count(), 'torch': 'torch' in sys.modules,\n"
               "                  'service': 'daemon.service' in sys.modules,\n"
               "                  'http': 'daemon.fronts.http' in sys.modules}))\n")
    assert got["collections"] == 0  # the collector never ran during those imports
    assert got["enabled"] is True
    assert got["frozen"] > 100_000  # torch alone makes several hundred thousand objects
    assert got["torch"] and got["service"] and got["http"]


def test_a_disabled_collector_stays_disabled():
    got = _run("import gc, json\n"
               "import daemon.main\n"
               "gc.disable()\n"
               "daemon.main.import_serving_modules()\n"
               "print(json.dumps({'enabled': gc.isenabled()}))\n")
    assert got == {"enabled": False}
