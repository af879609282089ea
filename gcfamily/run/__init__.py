"""The run: the loop and what it is built from, one room per concept.

trainer.py            Trainer: the loop (data -> prepare -> step -> log -> checkpoint), composing the rooms below
build.py              building a run: device, threads, policy, method, optimizer, a resume's restore
step.py               one optimizer step: backward over micro-batches, the step's metrics, apply (finite, clip, step)
budget.py             max_time / max_tokens / max_flops spent, and when eval_every_s falls due
console.py            the console lines and the progress bar
folder/               the run folder as a transaction (RunFolder): lock, ownership, refusals, resume, atomic writes
checkpoint_format.py  a checkpoint folder's files: written atomically, checked, found, read
saving.py             Saving: what a checkpoint holds and its restore, the final model folder, card and summary
evaluation.py         Evaluation: the rows a run trains and validates on, and its held-out figures
heldout.py            held-out generation and scoring functions (gcf eval and Evaluation)
services.py           RunServices: what a method may ask of the run
view.py               TrainerView: the Trainer as its adapters type it
distributed.py        DistEnv: processes under torchrun, DDP / FSDP2, collectives
distributed_save.py   saving under torchrun: gathered checkpoints, the final folder from rank 0
launch.py             gcf run --nproc N under torchrun
logger.py             metrics.jsonl, TensorBoard, W&B
card.py, summary.py   the model card and the console's closing lines (figures.py: what both read back)
curves.py             curves.png
"""
