from loom.cli import main

raise SystemExit(main())
