from thinwire.cli import main

raise SystemExit(main())
