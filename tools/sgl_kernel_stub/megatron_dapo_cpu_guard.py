"""Three import-time fixes for SGLang 0.5.23 on a CPU torch in .venv-sglang.

1. --enable-return-routed-experts (--moe-routing-replay) on a CPU server: the routed-experts host buffer is
allocated with pin_memory=True (sglang/srt/layers/moe/state_capturer/base.py:68) through
mem_cache/pool_host/common.py:349 alloc_with_host_register -> :147 `_cuda_host_register` -> torch.cuda.cudart(),
which asserts "Torch not compiled with CUDA enabled" and kills the server at start-up. Without CUDA there is
nothing to register: `_cuda_host_register` becomes a no-op when that module is imported and CUDA is unavailable
(a CUDA build keeps SGLang's own). The buffer is then plain host memory, which is all a CPU server reads.

2. PyPI's (CUDA-built) torchvision next to a CPU torch:

torchvision's C++ ops cannot load without libtorch_cuda, and torchvision/_meta_registrations.py then dies at
import ('operator torchvision::nms does not exist'), taking every module that imports torchvision down
(SGLang imports it for its multimodal configs, never for Qwen2). This finder serves that one module as an
empty one when the ops are missing, so `import torchvision` works and any real use of a torchvision op
still fails loudly with torchvision's own "Couldn't load custom C++ ops" error.

3. DeepSeek-V2/V3 (MLA) on --attention-backend torch_native: DeepseekV2AttentionMLA picks its forward method from
a registry keyed by backend name (models/deepseek_common/attention_backend_handler.py); torch_native is not in it,
so get_handler (:55) falls back to the triton handler, which sends an extend without a cached prefix to the MHA
path (:251): per-head k [nope | rope] / v, passed to attn_mha with save_kv_cache=False
(attention_forward_methods/forward_mha.py:310). TorchNativeAttnBackend.forward_extend ignores the k / v it is
given and reads the layer's pool instead (layers/attention/torch_native_backend.py:315), which for MLA holds the
latent [kv_lora_rank | rope], so the first prefill (the start-up warm-up) dies in its SDPA (:160: "Expected size for
first two dimensions of batch2 tensor to be: [4, 24] but got: [4, 40]" at the tiny model). No server flag avoids
it (--enable-deterministic-inference, which routes extends to MLA, refuses torch_native). Without CUDA this
registers "torch_native" -> `_dispatch_mla_subtype`, the absorbed-MLA path SGLang already takes for every decode
(and for extends under deterministic inference or graph capture): q absorbed through w_kc, attention over the
latent pool with one shared kv head, output through w_vc, which torch_native's SDPA computes as any MQA. Measured
(docs/DEEPSEEK_V3.md): a tiny fp32 DeepseekV3ForCausalLM then serves HF's log-probs within 5e-6. Only
models whose attention consults that registry (the DeepSeek MLA family) are affected.
Loaded by the .pth file that tools/setup_sglang_env.sh writes; never used in the main .venv.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

_GUARDED = "torchvision._meta_registrations"
_HOST_REGISTER = "sglang.srt.mem_cache.pool_host.common"


class _HostRegisterFinder(importlib.abc.MetaPathFinder):
    """Loads _HOST_REGISTER as usual, then (no CUDA) replaces its `_cuda_host_register` with a no-op."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _HOST_REGISTER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            import torch

            if not torch.cuda.is_available() and hasattr(module, "_cuda_host_register"):
                module._cuda_host_register = _no_host_register

        spec.loader.exec_module = exec_module
        return spec


def _no_host_register(*args, **kwargs):
    """CPU torch: no page-locking to do (SGLang's `_cuda_host_register` would assert on torch.cuda.cudart())."""
    return None


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname != _GUARDED:
            return None
        extension = sys.modules.get("torchvision.extension")
        if extension is not None and extension._has_ops():
            return None  # a working torchvision build: leave it alone
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        return None


sys.meta_path.insert(0, _Finder())
sys.meta_path.insert(0, _HostRegisterFinder())


_MLA_HANDLERS = "sglang.srt.models.deepseek_common.attention_backend_handler"


class _TorchNativeMlaFinder(importlib.abc.MetaPathFinder):
    """Loads _MLA_HANDLERS as usual, then (no CUDA) gives torch_native the absorbed-MLA handler (fix 3)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _MLA_HANDLERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            import torch

            registry = module.AttentionBackendRegistry
            if not torch.cuda.is_available() and "torch_native" not in registry._handlers:
                registry.register("torch_native", module._dispatch_mla_subtype)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _TorchNativeMlaFinder())
