"""The run: the loop (trainer), the run folder as a transaction, checkpoints, saving, evaluation, distributed
processes, the launcher, the logger and the model card.
"""
