"""The 8B Q4_K_M file loaded on ONNX Runtime in-process (no self-check, nominal costs): peak RSS
to ready (VmHWM), then resident while serving a few greedy tokens."""
import json, time, sys
t = time.time()
from edge_runtime.engine import Engine
from edge_runtime import SamplingParams
def status():
    return {l.split(':')[0]: int(l.split()[1]) // 1024 for l in open('/proc/self/status')
            if l.startswith(('VmRSS', 'RssAnon', 'RssFile', 'VmHWM'))}
e = Engine.load("/tmp/mace-random-gguf/llama-3.1-8b-random-q4_k_m.gguf", backend="onnxruntime",
                onnx_quantization="q4_1", dtype="float32", num_threads=2, cost_profile="off")
ready = {"ready_s": round(time.time() - t, 1), **status()}
print("ready", ready, flush=True)
open('/proc/self/clear_refs', 'w').write('5')
t = time.time(); out = e.generate("Give me a tip for cooking rice.", SamplingParams(max_tokens=4, ignore_eos=True))[0]
serve = {"tok_s": round(len(out.candidates[0].token_ids) / (time.time() - t), 3), **status()}
print(json.dumps({"ready": ready, "serving": serve, "loadavg": open('/proc/loadavg').read().strip()}), flush=True)
