"""The in-memory snapshot tier: each rank's state held in its peers' memory, a tier above the
checkpoints on storage and never in place of them.

At every `CheckpointConfig.snapshot_every`-th report, each rank takes its *piece* of the round
(`report(snapshot=...)`) and sends it to two holders: its own nanny, which outlives the rank's
process, and a peer worker's, which outlives the rank's node. A rank that fails because a peer
went away may save a just-in-time piece before it leaves (`enable_jit_checkpoint`). A restart
takes the newest complete round newer than the latest checkpoint on storage, and each rank of
the new group fetches every piece of it, checks it, and restores from it as from storage.

The modules, by who runs them:

- `rank`: the rank's side: take a piece, send it in the background, save just in time, and
  fetch and unpack a round to restore (in the rank's process).
- `piece`: what one piece is (`SnapshotPiece`) and one round (`SnapshotRound`), as every module
  other modules pass them; a piece's dict form only where it crosses Dask's comms.
- `format`: what a piece's bytes are, written down once: a flat buffer or a zip, and the CRC-32s
  a restoring rank checks (in the rank's process, packing and unpacking).
- `piece_files`: a piece as a file in the host's shared memory, one copy for the holders on the
  rank's host (the rank and the holders).
- `store`: the holder's side: the pieces a nanny (or a worker without one) holds, behind four
  handlers on its Dask server.
- `holders`: the driver's side: who holds each rank's pieces, and what the holders hold.
- `rounds`: the controller's view: which round, if any, a restart restores from.

Its files on a node (the pieces in shared memory, a `save(directory)` before it is packed, a
restored round) are in folders of the node's scratch space, which `ft_train.worker.scratch`
owns, as it owns /dev/shm for every other user.

Where a piece goes: the rank's `RankSnapshots` -> `store.SnapshotStore.put` on each holder ->
`holders.held` (the driver asks every holder) -> `rounds.SnapshotTier.choose` (the controller)
-> `RankSpec.snapshot` of every rank of the next group -> `RankSnapshots.restored`.
"""
