from pagectl.cli import main

raise SystemExit(main())
