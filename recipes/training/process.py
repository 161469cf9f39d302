"""How a recipe process ends: a library error translated to the one-line error the user should read, and an exit
that neither frees a DDP model nor finalizes the interpreter under gloo's worker threads (torch 2.13.0)."""
from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

from recipes import RecipeError


def explained(err: Exception) -> RecipeError | None:
    """`err` as the one-line RecipeError the user should read, or None when it is not one the recipe explains.

    torch 2.13.0's DDP raises "Expected to have finished reduction in the prior iteration" at the step after one in
    which a parameter got no gradient (an encoder with layers its classifier does not use, e.g. a DeBERTa-v2 config
    with relative attention but no pos_att_type), with a long message about find_unused_parameters.
    """
    if isinstance(err, RecipeError):
        return err
    if isinstance(err, RuntimeError) and "Expected to have finished reduction in the prior iteration" in str(err):
        return RecipeError("some parameters of the model got no gradient in a step, which DDP refuses: add "
                           "--ddp_find_unused_parameters (or remove the unused layers from the model's config)")
    return None

_HELD: list = []

def hold_until_exit(model) -> None:
    """Keep the prepared model alive until `exit_process` ends the process, which frees nothing.

    torch 2.13.0: freeing a DDP model frees its Reducer, whose destructor destroys the gloo process group it holds on
    the freeing thread, which holds the GIL, and joins gloo's run-loop thread there; that thread may be freeing a
    finished work whose tensors Python owns (an all-gather inside a barrier), which needs the GIL: a deadlock. Seen
    once in a suite run, when cls.main returned and its frame freed the model: rank 1 hung after the run had ended
    (gdb: the main thread in ~ProcessGroupGloo -> std::thread::join, pt_gloo_runloop in ~AsyncAllgatherWork ->
    decref -> take_gil). Held here, the model outlives main; a later call in the same process (tests, the bench's
    `alternate`) replaces it, and one process has no group to destroy."""
    _HELD[:] = [model]

def exit_process(code: int) -> NoReturn:
    """Leave the process with `code` once the run is over, without tearing the interpreter down.

    torch 2.13.0's gloo backend runs each collective on a native worker thread of its process group; the thread drops
    its reference to the finished work (and the tensors in it) a moment after the caller's wait returns, and freeing
    a tensor Python owned takes the GIL. If the main thread is finalizing the interpreter by then, CPython ends the
    worker thread (pthread_exit) and the unwind aborts the process: "terminate called without an active exception",
    exit -6, after final/ was written, so a scheduler requeues a finished run (pytorch/pytorch#190489); seen here
    after a zero3_offload launch and, in a suite run of the previous revision, after an FSDP2 one. Destroying the
    process groups first joins those threads only for groups nothing else holds: DeepSpeed 0.19.8 keeps its groups in
    deepspeed.utils.groups and on every ZeRO-3 parameter (ds_process_group). Measured with 2 gloo ranks ending on an
    all-gather on a group a module keeps (tests/exit_race_worker.py): 10 of 20 launches aborted at a normal exit, 0 of
    20 through this function. Python's exit functions (logging, file locks, tracker sessions) run first, as at any
    exit;     only the finalization is skipped.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
