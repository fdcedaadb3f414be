"""Run a tinker-cookbook recipe, unmodified, against ``rlpipe serve`` with a local model and local data.

    python examples/cookbook/run_recipe.py rl_loop model_name=/path/to/model base_url=http://127.0.0.1:8000 \
        log_path=/tmp/rl-loop max_steps=3 batch_size=2 group_size=4 max_tokens=24

The first argument names the recipe (``rl_loop`` or ``sl_loop``, the modules
``tinker_cookbook.recipes.rl_loop`` and ``.sl_loop``); the rest are the recipe's
own chz arguments, handed to it as they are. Run it with the cookbook's Python
(``.venv-cookbook/bin/python``), not the server's.

The recipes are written for hub models and hub data. Three things stand in, and
nothing else changes:

* the tokenizer: ``model_name`` is the served model's local folder (``rlpipe
  serve`` names a base model by its path), registered with the cookbook's
  ``tokenizer_utils.register_tokenizer`` so it loads from that folder;
* the renderer name: ``model_info`` knows only hub names and has no registration
  hook, so the local folder is added to its lookup with ``--renderer`` (default
  ``qwen3_instruct``, the ChatML format of the tiny model's chat template);
* the data: the recipes' ``datasets.load_dataset`` calls for ``openai/gsm8k`` and
  ``HuggingFaceH4/no_robots`` read small files in ``data/`` of the same shape.
"""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path
from typing import Any

import chz
import datasets
from tinker_cookbook import model_info, tokenizer_utils

DATA_DIR = Path(__file__).resolve().parent / "data"
RECIPES = ("rl_loop", "sl_loop")
# hub dataset id -> the local file of the same shape that stands in for its train split
LOCAL_DATASETS = {
    "openai/gsm8k": DATA_DIR / "gsm8k_train.jsonl",
    "HuggingFaceH4/no_robots": DATA_DIR / "no_robots_train.jsonl",
}


def register_local_model(model_dir: str, renderer_name: str) -> None:
    """Make the cookbook load ``model_dir``'s tokenizer from the folder and render it with ``renderer_name``."""
    from transformers import AutoTokenizer

    tokenizer_utils.register_tokenizer(model_dir, lambda: AutoTokenizer.from_pretrained(model_dir))
    attributes = model_info.ModelAttributes(organization="local", version_str=Path(model_dir).name,
                                            size_str="local", is_chat=True, recommended_renderers=(renderer_name,))
    hub_lookup = model_info.get_model_attributes

    def get_model_attributes(model_name: str) -> model_info.ModelAttributes:
        return attributes if model_name.split(":", 1)[0] == model_dir else hub_lookup(model_name)

    model_info.get_model_attributes = get_model_attributes


def use_local_datasets() -> None:
    """Answer ``load_dataset`` for the hub ids in ``LOCAL_DATASETS`` from the local files (a ``train`` split)."""
    hub_load = datasets.load_dataset

    def load_dataset(path: str, *args: Any, **kwargs: Any) -> Any:
        if path in LOCAL_DATASETS:
            return hub_load("json", data_files={"train": str(LOCAL_DATASETS[path])})
        return hub_load(path, *args, **kwargs)

    datasets.load_dataset = load_dataset


def model_name_argument(recipe_args: list[str]) -> str:
    """The value of the recipe's ``model_name=`` argument; it must be a local folder."""
    names = [arg.split("=", 1)[1] for arg in recipe_args if arg.startswith("model_name=")]
    if not names or not os.path.isdir(names[-1]):
        raise SystemExit("give model_name=<the served model's local folder>, as `rlpipe serve` prints it")
    return names[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe", choices=RECIPES)
    parser.add_argument("--renderer", default="qwen3_instruct",
                        help="the cookbook renderer for the local model (its chat format)")
    args, recipe_args = parser.parse_known_args()
    register_local_model(model_name_argument(recipe_args), args.renderer)
    use_local_datasets()
    recipe = importlib.import_module(f"tinker_cookbook.recipes.{args.recipe}")
    chz.nested_entrypoint(recipe.main, argv=recipe_args)


if __name__ == "__main__":
    main()
