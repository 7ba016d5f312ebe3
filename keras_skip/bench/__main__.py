from keras_skip.bench.harness import main

raise SystemExit(main())
