"""The run folder as a transaction: one owner at a time, never two runs mixed, resume means the same run, and a start
that fails leaves the folder as it was.

- The lock (`.gcf.lock`, lock.py) is taken before anything is written: one owner at a time.
- The run's record (`.gcf-run.json`) lists the top-level names the run owns: every gcfamily run name (RUN_FILES,
  model-*.safetensors shards, .tmp-* leftovers) that nothing held when a start claimed it, written before the run
  writes anything. A name claimed stays the run's (a file the user puts there later counts as the run's). --overwrite
  removes exactly the owned entries (and the record), nothing else; a folder with no record is a run only when it holds
  a run_config.json that gcfamily wrote (a dict naming a `method`), written before records existed: its owned entries
  are the gcfamily run names present. A folder whose entries bear gcfamily's names but were not written by a run (a
  user's own `checkpoints/` or `vocab.json`) is refused, with or without --overwrite, and so is the current directory
  (an explicit --output-dir, please). A folder of other files and no run is refused without --overwrite; with it the
  run writes beside them and removes none (`gcf bench` writes its spec and log into a run's folder before the run
  starts with --overwrite). User files beside a run's are never removed.
- A folder that holds another run is refused unless --overwrite or --resume. --overwrite sets the owned entries aside
  in `.gcf-replaced/` while the start runs its checks, and removes them only once every check has passed; a set-aside
  run that a killed start left is put back by the next start. A --model inside an entry of the run (its checkpoints)
  is refused before anything moves; so is the folder that is the --model itself.
- The record also lists the run's segments: where each start began (step, and the checkpoint it resumed). A resume
  from step b supersedes the folder's checkpoints past b (an older branch): at commit they move to
  `checkpoints/replaced-at-step-b/` (named in the record first, so a kill mid-move is finished by the next start), so
  `--resume` (latest) continues the newest segment and never an older branch. A resume of a checkpoint from outside
  the folder's checkpoints/ into a folder that holds a run is refused (two runs would mix).
- A resume compares the requested settings with those the checkpoint was written under (recorded in the checkpoint;
  for an older checkpoint, its run folder's run_config.json), wherever the run continues: a setting that changes the
  trajectory may differ only with allow_changed_settings=true, which records the change; metrics and completions
  logged after the resumed step are dropped (they are about to be logged again), and half-written checkpoint folders
  are removed.
- A run folder is untrusted input (copied between machines, downloaded): the record is validated before anything acts
  on it (every owned name one a run writes, never a pattern of the user's; a pending move only of checkpoints/step-N
  into checkpoints/replaced-at-step-B, through no link, inside the folder), and so is a set-aside run (a folder of run
  names only); one that does not validate is one sentence and nothing changes.
- Before training the folder must be writable and hold room for a checkpoint.
- Until the start commits (RunFolder.commit) nothing already in the folder is changed or removed, only set aside (the
  record excepted: its old bytes are kept and written back); a start that fails removes what it wrote (`snapshot`,
  `remove_new`) and puts back what it set aside, so the folder is byte for byte as it was, and a folder it made is
  removed.

The rooms, each one responsibility:

    transaction.py  RunFolder, the face: open (refuse, lock, choose a resume's checkpoint), commit, abandon
    lock.py         RunLock: one owner at a time (`.gcf.lock`)
    ownership.py    the names a run writes and owns, and its record (`.gcf-run.json`)
    checks.py       the refusals made before anything moves: target, contents, writable, room
    aside.py        what a start sets aside or adds, undone when it fails
    resuming.py     a resume's settings compared, its logs cut back, the branch it leaves set apart
    writes.py       writes that complete or leave the file as it was (WriteFailed, resume_hint)
"""

from gcfamily.run.folder.transaction import RunFolder

__all__ = ["RunFolder"]
