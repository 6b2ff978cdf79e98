"""Only the worker carries torch: the other four processes of a running stack never map it, even
after serving a JSON-constrained chat completion (tokenizer, chat template, detokenizer, the JSON
controller's grammar)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest

LEAN_SERVICES = ("gateway", "scheduler", "controller_runtime", "session_store")


def maps_torch(pid: int) -> bool:
    """Whether the process has torch's shared library mapped (what ``import torch`` loads)."""
    return any("libtorch" in Path(line.rsplit(" ", 1)[-1]).name
               for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/maps")
def test_only_the_worker_maps_torch(stack):
    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)
    schema = {"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}
    reply = client.chat.completions.create(
        model=stack.settings.served_model_name,
        messages=[{"role": "user", "content": "Name a color as JSON."}],
        max_tokens=24,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "color", "schema": schema}},
    )
    assert reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content)["color"], str)

    assert maps_torch(stack.pid("worker")), "the check finds torch where it is loaded"
    loaded = [name for name in LEAN_SERVICES if maps_torch(stack.pid(name))]
    assert loaded == [], f"torch is loaded in {loaded}"


def torch_imported(code: str) -> bool:
    """Whether running ``code`` in a fresh interpreter leaves torch in ``sys.modules``."""
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.parametrize("module", [f"services.{name}.__main__" for name in LEAN_SERVICES])
def test_service_modules_import_without_torch(module):
    """A service's entry module, with the tokenizer loaded as the services load it."""
    assert not torch_imported(f"import {module}\nfrom common.config import Settings\n"
                              "from common.model_source import load_tokenizer\nload_tokenizer(Settings())")


def test_image_processor_loads_torch_only_with_the_first_image():
    """A gateway serving a vision-language model reads its image facts without torch; transformers'
    image processor (which imports torch whenever it is installed) loads with the first image."""
    load = ("from common.config import Settings\n"
            "from services.gateway.salience.images import ImageSupport\n"
            "spec = ImageSupport.load(Settings(model='random:qwen2-vl-tiny')).spec\n"
            "assert spec is not None and spec.merge_size == 2")
    torch_imported(load)  # the first load writes the test model's files (its config through transformers': torch)
    assert not torch_imported(load)
    image = "\nfrom tests.images import png\nassert spec.process(spec.decode(png(0, (56, 56)))).grid_thw == (1, 4, 4)"
    assert torch_imported(load + image)
