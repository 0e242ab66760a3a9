"""The checkpoint formats this package writes and reads, one module each, with no Lightning import:

- ``fs``: opening inside a folder without following links, checked names, exact-name cleanup, free space, digests;
- ``atomic``: a folder written under a staging name and renamed into place;
- ``destination``: which folders a conversion may replace, one writer at a time, staging removed on failure,
  write failures in words naming the file;
- ``save_digests``: ``SAVE_DIGESTS.json``, what binds the files of one DCP save together (a SHA-256 per stored
  record of a storage file, so that a damaged byte is refused naming its tensor, and per other file);
- ``manifest``: ``MANIFEST.json``, every file's SHA-256 and the conversion's provenance;
- ``rank_file``: one target rank's file of a resharded checkpoint (``rank_{r}/{prefix}{r}.pt``);
- ``resharded_folder``: which rank file a rank reads, and ``verify_checkpoint``;
- ``live_state``: a loaded rank file back into DTensors or a live state dict;
- ``resharded_load``: ``Trainer.fit(ckpt_path=)`` of a resharded folder, for ``SinkModelParallelStrategy``;
- ``dcp_folder``, ``dcp_load``: Lightning-style sharded DCP folders (with ``meta.pt`` and ``layout.json``), saved
  atomically and loaded with every pickle read restricted;
- ``agreement``: ranks on several nodes agreeing that they see the same checkpoint, before a save commits and before
  a resume loads (a checkpoint path on node-local disk fails on every rank at once);
- ``resume_agreement``: every rank resumes from one checkpoint (the identity of what each would load compared before
  anything is loaded: a stale copy of another step on one node fails on every rank, naming the steps);
- ``ckpt_file``: a whole-file ``.ckpt`` read through Lightning, an unreadable one refused in one line naming it.
"""
