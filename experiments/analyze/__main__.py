from experiments.analyze.command import main

main()
