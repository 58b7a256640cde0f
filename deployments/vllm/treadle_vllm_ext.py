"""vLLM worker extension that loads a weight version directory into the running model.

Loaded by the vLLM server process (``--worker-extension-cls
treadle_vllm_ext.WeightReloadExtension``, this folder on ``PYTHONPATH``), never by treadle
itself. ``VLLMEngine.load_version`` calls it through ``POST /collective_rpc`` with
``{"method": "treadle_reload_weights", "kwargs": {"path": DIR}}``.
"""

from __future__ import annotations

import glob
import os


def policy_files(path: str) -> list[str]:
    """The policy's safetensors files in a weight version directory: ``model.safetensors``
    or Hugging Face shards ``model-0000k-of-0000n.safetensors``. The directory also holds
    the trainer's value model (``value_model.safetensors``), which is not the policy: vLLM
    refuses its tensors after it has streamed in the policy's."""
    files = sorted(glob.glob(os.path.join(path, "model*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no model*.safetensors files in {path!r}")
    return files


class WeightReloadExtension:
    """Mixed into each vLLM GPU worker; ``self`` is the worker."""

    def treadle_reload_weights(self, path: str) -> str:
        """Load the policy's safetensors files of ``path`` into the model in place."""
        from safetensors import safe_open

        files = policy_files(path)

        def weights():
            for file in files:
                with safe_open(file, framework="pt", device="cpu") as handle:
                    for key in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                        yield key, handle.get_tensor(key)

        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        loaded = model.load_weights(weights())
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        process_weights_after_loading(model, runner.model_config, self.device)
        return f"loaded {len(loaded) if loaded is not None else 'all'} tensors from {path}"
