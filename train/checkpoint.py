"""Orbax checkpoints of everything a run needs to continue bit-exactly: parameters, optimizer state, the
model's other state (its dropout RNG) and the step, which is also the data position (`data.py` makes batch
`step` from the seed and the step alone).
"""

from __future__ import annotations

import pathlib
import shutil

import jax
import orbax.checkpoint as ocp


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _key_data(tree):
    # Orbax stores plain arrays; typed PRNG keys travel as their raw data and are re-wrapped on restore.
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


class Checkpointer:
    """Saves {params, opt_state, rest} with a JSON record {step, data_step, config} under `directory`."""

    def __init__(self, directory: pathlib.Path, *, keep: int):
        self.directory = pathlib.Path(directory).absolute()
        self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep))

    @staticmethod
    def clear(directory: pathlib.Path) -> None:
        shutil.rmtree(directory, ignore_errors=True)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict, record: dict) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(_key_data(state)), record=ocp.args.JsonSave(record)),
        )

    def restore(self, like: dict, step: int | None = None) -> tuple[dict, dict]:
        """The state saved at `step` (default: latest), shaped and placed like `like`, and its record."""
        step = self.manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _key_data(like))
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), record=ocp.args.JsonRestore())
        )
        state = jax.tree.map(
            lambda saved, ref: (
                jax.random.wrap_key_data(saved, impl=jax.random.key_impl(ref)) if _is_key(ref) else saved
            ),
            restored.state,
            like,
        )
        return state, restored.record

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
