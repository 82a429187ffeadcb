// The extension's linter (make lint): typescript-eslint's recommended rules, type-aware where
// they catch real mistakes (a promise nobody awaits), and no `any`: a message from the server
// gets a type (src/model.ts ServerMessage) and is checked before use.
import tseslint from 'typescript-eslint';

export default tseslint.config(
  { ignores: ['lib/**', 'node_modules/**', '../gpu_lab/**', 'eslint.config.mjs'] },
  ...tseslint.configs.recommended,
  {
    files: ['src/**/*.ts'],
    languageOptions: { parserOptions: { project: './tsconfig.json' } },
    rules: {
      '@typescript-eslint/no-explicit-any': 'error',
      '@typescript-eslint/no-floating-promises': 'error',
      '@typescript-eslint/no-unused-vars': ['error', { argsIgnorePattern: '^_' }],
      // JupyterLab's idiom for command ids (namespace CommandIDs { export const ... })
      '@typescript-eslint/no-namespace': 'off',
      eqeqeq: ['error', 'smart']
    }
  }
);
