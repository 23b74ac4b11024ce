from model_runner.kernels import main

raise SystemExit(main())
