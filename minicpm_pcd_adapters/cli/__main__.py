"""`python -m minicpm_pcd_adapters.cli`: the `pcd` command."""

from minicpm_pcd_adapters.cli.main import main

raise SystemExit(main())
