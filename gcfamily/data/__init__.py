"""Rows in, ids and batches out: sources (files, folders, the hub), TRL's formats, preference pairs, batches."""
