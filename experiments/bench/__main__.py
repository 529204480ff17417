from experiments.bench import main

main()
