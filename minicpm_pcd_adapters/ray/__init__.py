"""The engine on a Ray cluster: one engine per actor or replica, loaded once.

data.py   Ray Data: `classify_dataset` maps batches of rows through engine actors
files.py  `pcd classify --ray`: a file's lines through Ray Data, resumable, one record per line
serve.py  Ray Serve: `pcd serve`'s app as a deployment with replicas
"""
